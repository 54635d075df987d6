"""LLMEngine: add_request / abort_request / step — schedule -> execute -> update -> detokenize.

Owns the wiring of the rooms (model, KV cache, scheduler, runner, tokenizer) and the bookkeeping a
user sees: a request with `n > 1` fans out into n child requests sharing the prompt (child i seeded
from (seed, i)), whose progress is gathered back into one RequestOutput.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY, GPU_MEMORY_FRACTION, EngineConfig
from tokenmill.core.kv_manager import KVManager
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.core.static import StaticScheduler
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.layers.sampler import generator_seed
from tokenmill.models.loader import load_model, resolve_dtype
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats, TokenLogprob
from tokenmill.request import Request, RequestStatus, RequestTimes
from tokenmill.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_cache_budget, num_blocks_for_memory
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


@dataclass
class Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    text_delta: str = ""
    finish_reason: str | None = None


@dataclass
class Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    children: list[Child] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    held: list[Request] = field(default_factory=list)  # children waiting for child 0's prompt to be cached


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device)
        self.model = load_model(config.model, dtype=config.dtype, device=device)
        self.model_config = self.model.config
        self.tokenizer = Tokenizer(config.model)
        dtype = resolve_dtype(config.dtype, self.model_config)
        max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings
        )
        budget = kv_cache_budget(device, config.kv_cache_memory, DEFAULT_CPU_KV_CACHE_MEMORY, GPU_MEMORY_FRACTION)
        num_blocks = num_blocks_for_memory(self.model_config, config.block_size, dtype, budget)
        if num_blocks * config.block_size < max_model_len:
            per_block = kv_bytes_per_block(self.model_config, config.block_size, dtype)
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold {num_blocks * config.block_size} tokens of KV, fewer than "
                f"max_model_len ({max_model_len}); give at least {-(-max_model_len // config.block_size) * per_block} "
                "bytes or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            budget / 2**20,
            dtype,
        )
        caches = allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype, device)
        self.runner = ModelRunner(self.model, caches, config.block_size)
        kv = KVManager(
            num_blocks,
            config.block_size,
            watermark_blocks=max(1, num_blocks // 100),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
        scheduler_cls = StaticScheduler if config.scheduling == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(sched_config, kv)
        self.max_model_len = max_model_len
        self._rng = random.Random(config.seed)
        self._parents: dict[str, Parent] = {}
        self._children: dict[str, tuple[Parent, int]] = {}  # internal child id -> (parent, index)
        self._next_id = 0
        self.num_aborted = 0  # requests aborted (by a client gone, a shutdown, or a caller)
        self.last_step = StepStats(0, 0, 0.0, 0.0, 0, 0)

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self._parents:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt: must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within the maximum model length "
                f"({self.max_model_len})"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = Parent(request_id, text, ids, params, arrival)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        requests = []
        for i in range(params.n):
            internal_id = str(self._next_id)
            self._next_id += 1
            request = Request(
                request_id=internal_id,
                prompt_token_ids=ids,
                sampling_params=params,
                seed=generator_seed(base_seed, i),  # child i seeded from (seed, i)
                max_tokens=max_tokens,
                eos_token_ids=self.tokenizer.info.eos_token_ids,
                times=RequestTimes(arrival=arrival),
                cache_salt=cache_salt,
            )
            requests.append(request)
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
            )
            parent.children.append(Child(request, detok, [] if params.logprobs is not None else None))
        self.scheduler.add_request(requests[0])  # validates (and may raise) before anything is registered
        if self.config.enable_prefix_caching:
            # n > 1 with prefix caching: the other children start once child 0 has computed (and so
            # cached) the prompt, and share its blocks instead of computing it n times.
            parent.held = requests[1:]
        else:
            for request in requests[1:]:
                self.scheduler.add_request(request)
        for i, request in enumerate(requests):
            self._children[request.request_id] = (parent, i)
        self._parents[request_id] = parent

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is (children still held included) and free its blocks now;
        False when no such request is open."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        self.num_aborted += 1
        for child in parent.children:
            self.scheduler.finish_request(child.request.request_id, RequestStatus.FINISHED_ABORTED)
            self._children.pop(child.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        now = time.monotonic()
        scheduled = self.scheduler.schedule(now)
        result = self.runner.execute(scheduled)
        now = time.monotonic()
        changed = self.scheduler.update(scheduled, result, now)
        for request in changed:
            parent, index = self._children[request.request_id]
            if index == 0 and parent.held:
                for held in parent.held:
                    self.scheduler.add_request(held)
                parent.held = []
        touched: dict[str, Parent] = {}
        for request_id, rows in result.prompt_logprobs.items():
            parent, index = self._children[request_id]
            if index == 0 and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(rows)
        for request in changed:
            parent, index = self._children[request.request_id]
            child = parent.children[index]
            new_tokens = result.sampled.get(request.request_id, [])
            if child.logprobs is not None:
                child.logprobs.extend(result.logprobs.get(request.request_id, []))
            update = child.detokenizer.add_tokens(new_tokens)
            child.text_delta = update.text_delta
            if update.stop_string is not None:  # a stop string wins over EOS or length in the same step
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, update.stop_string)
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, update.stop_string
                request.times.finished = now
            elif request.status.finished:
                child.text_delta += child.detokenizer.flush()
            if request.status.finished:
                child.finish_reason = request.status.value
            touched[parent.request_id] = parent
        outputs = [self._output(p) for p in touched.values()]
        for out in outputs:
            if out.finished:
                self._release(self._parents.pop(out.request_id))
        self.last_step = StepStats(
            num_running=len(scheduled.chunks),
            num_batched_tokens=scheduled.num_batched_tokens,
            total_seconds=time.perf_counter() - start,
            forward_seconds=result.forward_seconds,
            kv_live_tokens=sum(r.num_computed_tokens for r in self.scheduler.running),
            kv_allocated_slots=self.scheduler.kv.num_allocated_slots(),
        )
        return outputs

    def _release(self, parent: Parent) -> None:
        for child in parent.children:
            self._children.pop(child.request.request_id, None)

    def _output(self, parent: Parent) -> RequestOutput:
        completions = []
        for i, child in enumerate(parent.children):
            r = child.request
            completions.append(
                CompletionOutput(
                    index=i,
                    text=child.detokenizer.output_text,
                    token_ids=list(r.output_token_ids),
                    logprobs=child.logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=r.stop_reason,
                    text_delta=child.text_delta,
                )
            )
            child.text_delta = ""
        times = [c.request.times for c in parent.children]
        firsts = [t.first_scheduled for t in times if t.first_scheduled is not None]
        tokens = [t.first_token for t in times if t.first_token is not None]
        finished = all(c.finish_reason is not None for c in parent.children)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.children[0].request.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=parent.arrival,
                first_scheduled_time=min(firsts) if firsts else None,
                first_token_time=min(tokens) if tokens else None,
                finished_time=max(t.finished or 0.0 for t in times) if finished else None,
            ),
        )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's reset_prefix_cache); False while requests are in flight."""
        return self.scheduler.kv.reset_prefix_cache()

    def stats(self) -> dict[str, int | float]:
        s = self.scheduler.stats()
        return {
            "kv_blocks_total": s.kv_blocks_total,
            "kv_blocks_free": s.kv_blocks_free,
            "kv_cache_usage": 1 - s.kv_blocks_free / s.kv_blocks_total,
            "running": s.running,
            "waiting": s.waiting,
            "preemptions": s.preemptions,
            "aborted": self.num_aborted,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            "prefix_cache_evictions": s.prefix_cache_evictions,
        }
