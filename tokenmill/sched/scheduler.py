"""Scheduler: the one rule of the engine, continuous batching over a paged KV cache.

Each step hands out a token budget (`max_num_batched_tokens`) and moves requests'
`num_computed_tokens` toward their token count: running requests first (oldest first: a decode
asks for one token, an unfinished prompt for its next chunk), then waiting requests in arrival
order while there is room (`max_num_seqs`, budget, KV blocks). When blocks run out, the newest
running request is preempted: its blocks are freed and it waits, at the head of the queue, to be
recomputed. Chunked prefill and preemption fall out of this rule; there is no prefill phase.
A pooling request (an embedding, a reranker's score: `Request.pooling`) is a prompt and nothing more:
it finishes when the chunk reaching its last prompt token has run (the runner pooled it), its blocks
freed like any finished request's; one that pools every position (mean, CLS) takes no prefix-cache hit.

Two edges are protocols it calls and never branches on: a `KVConnector` (KV computed elsewhere comes
in at admission, a finished prefill's goes out; `NoKVConnector` by default) and a `DraftPolicy`
(which running requests send drafts this step, from the runner's guesses of the step before; `NoDrafts`
by default).

An error that belongs to one request (its KV allocation, applying its step's results, or one the
runner reports in `StepOutput.failed`) fails that request alone: it finishes as `FINISHED_ERROR`, its
blocks freed, and `take_failed` hands the engine why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

from tokenmill.errors import describe
from tokenmill.outputs import EngineStats, NewRequestData, ScheduledChunk, SchedulerOutput, StepOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sched.block_hash import chain_hashes
from tokenmill.sched.draft_policy import DraftPolicy, NoDrafts, count_positions
from tokenmill.sched.kv_connector import KVConnector, NoKVConnector
from tokenmill.sched.kv_manager import KVManager

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # most decode steps in a row a greedy decode may take in one engine step (runner/multi_step.py)
    decode_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        connector: KVConnector | None = None,
        drafts: DraftPolicy | None = None,
    ) -> None:
        """`connector`: KV transfer's edge (NoKVConnector: none); `drafts`: which requests take the
        runner's drafts each step (NoDrafts: none)."""
        self.config = config
        self.kv = kv
        # KV computed elsewhere comes in, and a prefill's goes out, through it (prefill/decode disaggregation)
        self.connector: KVConnector = connector or NoKVConnector()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # request id -> requests that start once it has computed its prompt (n > 1 children)
        self.held: dict[str, list[Request]] = {}
        self._finished_ids: list[str] = []
        self._scheduled_once: set[str] = set()
        self.failed: dict[str, str] = {}  # request id -> why it failed, until the engine reports it
        self.num_preemptions = 0
        self.num_aborted = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.drafts: DraftPolicy = drafts or NoDrafts()
        self.spec = self.drafts.counts  # speculative decoding's counters

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request, wait_for: str | None = None) -> None:
        """Queue a request; with `wait_for`, hold it until that request has computed its prompt (its
        first token sampled) or finished, so that it finds the prompt's blocks in the prefix cache. The
        request has passed the engine's front door: it fits the model's length and the cache."""
        # checked at the engine's front door (engine.request_checks): here only asserted
        assert request.request_id not in self.requests, f"request {request.request_id!r} is already queued"
        total = request.num_prompt_tokens + request.max_tokens
        assert total <= self.config.max_model_len, f"{total} tokens past max_model_len {self.config.max_model_len}"
        assert self.kv.blocks_for(total) <= self.kv.num_blocks, f"{total} tokens need more blocks than the cache"
        self.requests[request.request_id] = request
        awaited = self.requests.get(wait_for) if wait_for is not None else None
        if awaited is not None and not awaited.output_token_ids:
            self.held.setdefault(awaited.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish (or abort) a request wherever it is; its blocks are freed now."""
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            for awaited, held in list(self.held.items()):
                if request in held:
                    held.remove(request)
                    if not held:
                        del self.held[awaited]
        request.status = status
        request.stop_reason = stop_reason
        if status is RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        self.connector.finished(request, self.kv.block_table(request_id))
        self.kv.free(request_id)
        self._finished_ids.append(request_id)
        del self.requests[request_id]
        self._scheduled_once.discard(request_id)
        self._release(request_id)

    def fail_request(self, request_id: str, why: str) -> None:
        """Finish a request as failed by the engine (its blocks freed now); `failed` keeps why."""
        if request_id in self.requests:
            self.failed[request_id] = why
        self.finish_request(request_id, RequestStatus.FINISHED_ERROR)

    def take_failed(self) -> dict[str, str]:
        """The requests failed since the last call, and why."""
        failed, self.failed = self.failed, {}
        return failed

    def _release(self, request_id: str) -> None:
        """Queue the requests held for this one."""
        self.waiting.extend(self.held.pop(request_id, ()))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        draft_next = self.drafts.choose(self.running, budget)  # (this step's drafts set on the running requests)
        # several decode steps in a row only while nobody waits to be admitted (they would wait that long)
        grant = 1 if self.waiting or self.held else self.config.decode_steps
        chunks: list[ScheduledChunk] = []
        new: list[NewRequestData] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.draft_token_ids:
                if self._schedule_drafts(request, budget, chunks):
                    budget -= len(chunks[-1].token_ids)
                    i += 1
                    continue
                if request.status.finished:  # failed allocating its drafts' blocks (the next one is at i)
                    continue
            num_new = min(
                len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens, budget
            )
            while not self._allocate(request, request.num_computed_tokens + num_new):
                if request.status.finished:  # failed there: out of the running batch (the next one is at i)
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, num_new))
                budget -= num_new
                i += 1

        if not preempted:
            if grant > 1:
                chunks = [self._extend(chunk, grant) for chunk in chunks]
            budget = self._admit(budget, chunks, new, now)

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(new_requests=new, chunks=chunks, finished_request_ids=finished, draft_next=draft_next)

    def _schedule_drafts(self, request: Request, budget: int, chunks: list[ScheduledChunk]) -> bool:
        """A decoding request with draft tokens: its last token and the drafts that fit the budget and
        the free blocks, as one chunk. False (nothing scheduled) when it has none or none fits: it then
        decodes one token as usual (drafts never preempt anyone)."""
        drafts = request.draft_token_ids[: budget - 1]
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return False
        if not self._allocate(request, request.num_tokens + len(drafts)):
            return False
        chunks.append(self._chunk(request, 1, drafts))
        return True

    def _extend(self, chunk: ScheduledChunk, grant: int) -> ScheduledChunk:
        """`chunk` as a run of decode steps (`num_steps`) where its request may take one (`_steps`) and the
        slots for it are free above the watermark: asked once every running request's next token has
        its slot, so a run's reservation never preempts anyone; otherwise `chunk` as it was."""
        request = self.requests[chunk.request_id]
        steps = self._steps(request, grant) if len(chunk.token_ids) == 1 and not chunk.num_draft_tokens else 1
        try:
            if steps < 2 or not self.kv.allocate(request.request_id, request.num_computed_tokens + steps, True):
                return chunk
        except Exception:  # (its next token has its slot: the run is what is refused, not the request)
            logger.warning("request %s: no blocks for a run of decode steps", request.request_id, exc_info=True)
            return chunk
        table = self.kv.block_table(request.request_id)
        added, request.num_sent_blocks = table[request.num_sent_blocks :], len(table)
        return dataclasses.replace(chunk, new_block_ids=[*chunk.new_block_ids, *added], num_steps=steps)

    def _steps(self, request: Request, grant: int) -> int:
        """How many decode steps in a row `request` may take this step: up to `grant` for a greedy decode
        that wants no log-probabilities or structure, and no more than its tokens left (1 otherwise). The
        runner may take fewer (runner/multi_step.py); past a stop token, the tokens are dropped in `update`."""
        params = request.sampling_params
        decoding = bool(request.output_token_ids) and request.num_tokens - request.num_computed_tokens == 1
        if grant < 2 or request.pooling is not None or not decoding:
            return 1
        if not params.greedy or params.logprobs is not None or params.structured_outputs is not None:
            return 1
        left = min(request.max_tokens - len(request.output_token_ids), self.config.max_model_len - request.num_tokens)
        return max(1, min(grant, left))

    def _admit(self, budget: int, chunks: list[ScheduledChunk], new: list[NewRequestData], now: float) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self._prefix_hit(request)
            external = self._external(request, hit)
            num_new = min(request.num_tokens - request.num_computed_tokens - external, budget)
            if not self._reserve(request, external + num_new):
                if request.status.finished:  # failed there (out of the queue): the next one may fit
                    continue
                if hit:  # give the shared blocks back; the request retries from scratch next step
                    self.kv.free(request.request_id)
                    request.num_computed_tokens = 0
                break
            if external:  # admitted as a hit: its received KV is computed
                self.connector.allocated(request, self.kv.block_table(request.request_id), hit, external)
                request.num_computed_tokens += external
            self._count_prefix(request, hit)
            self._start(request, new, now)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return budget

    def _start(self, request: Request, new: list[NewRequestData], now: float) -> None:
        """Move the head of the queue into the running batch; the runner hears of it the first time."""
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
        if request.request_id not in self._scheduled_once:
            self._scheduled_once.add(request.request_id)
            new.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.seed,
                    request.eos_token_ids,
                    list(request.output_token_ids),  # (those another engine generated, for a received request)
                    request.pooling,
                )
            )

    def _prefix_hit(self, request: Request) -> int:
        """Start a request holding nothing at its longest cached prefix: whole blocks only, at most
        (tokens - 1) // block_size of them, so its last token is computed (it gives the first logits)
        and it never writes into a shared block. Prompt logprobs need every prompt token computed."""
        if (
            not self.kv.enable_prefix_caching
            or request.num_computed_tokens
            or request.sampling_params.prompt_logprobs is not None
            or (request.pooling is not None and request.pooling.needs_every_position)  # (mean, cls pooling)
        ):
            return 0
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks = self.kv.lookup_prefix(hashes)
        if blocks:
            self.kv.adopt_prefix(request.request_id, blocks, hashes[: len(blocks)])
            request.num_computed_tokens = len(blocks) * self.kv.block_size
        return request.num_computed_tokens

    def _external(self, request: Request, hit: int) -> int:
        """Tokens past the hit whose KV arrived from another engine (at a first admission only)."""
        if request.num_computed_tokens != hit:
            return 0
        return self.connector.external_tokens(request, hit)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first `num_blocks` full blocks; each block is hashed once
        in the request's life (admission lookups, failed admissions and caching share them)."""
        have = request.block_hashes
        if len(have) < num_blocks:
            bs = self.kv.block_size
            parent = have[-1] if have else None
            have.extend(
                chain_hashes(request.token_ids(len(have) * bs, num_blocks * bs), bs, request.cache_salt, parent)
            )
        return have[:num_blocks]

    def _count_prefix(self, request: Request, hit: int) -> None:
        if not self.kv.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return
        if request.pooling is not None and request.pooling.needs_every_position:  # (not looked up)
            return
        if request.num_preemptions == 0:  # a first admission: the user's view of caching
            request.num_cached_tokens = hit
        self.prefix_queries += request.num_tokens
        self.prefix_hits += hit

    def _reserve(self, request: Request, num_new: int) -> bool:
        """KV for an admission: the first chunk (and received KV), keeping a few blocks spare for
        running decodes (unless nothing runs: a request that fits the cache alone must always get in)."""
        total = request.num_computed_tokens + num_new
        return self._allocate(request, total, keep_watermark=bool(self.running))

    def _allocate(self, request: Request, num_tokens: int, keep_watermark: bool = False) -> bool:
        """KV blocks for a request's first `num_tokens` tokens (False: not enough free). An error in
        the allocation fails that request alone (False, and it is finished)."""
        try:
            return self.kv.allocate(request.request_id, num_tokens, keep_watermark=keep_watermark)
        except Exception as e:
            logger.warning("request %s: its KV blocks could not be allocated", request.request_id, exc_info=True)
            self.fail_request(request.request_id, describe("its KV blocks could not be allocated", e))
            return False

    def _chunk(self, request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start = request.num_computed_tokens
        table = self.kv.block_table(request.request_id)
        sent, request.num_sent_blocks = request.num_sent_blocks, len(table)
        token_ids = request.token_ids(start, start + num_new)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids + drafts if drafts else token_ids,
            start_position=start,
            new_block_ids=table[sent:],  # only what is new: the runner keeps the rest
            sample=start + num_new == len(request.prompt_token_ids) + len(request.output_token_ids),
            replace_block_table=sent == 0,
            num_draft_tokens=len(drafts) if drafts else 0,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_sent_blocks = 0  # readmitted with other blocks: the runner gets its whole table again
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, scheduled: SchedulerOutput, result: StepOutput, now: float) -> list[Request]:
        """Apply a step's results; returns the requests that changed (finished ones included, failed
        ones not: `take_failed` has those). An error applying one request's results fails it alone."""
        changed: list[Request] = []
        for chunk in scheduled.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            why = result.failed.get(chunk.request_id)
            if why is None:
                try:
                    self._update_one(request, chunk, result, now)
                    changed.append(request)
                    continue
                except Exception as e:
                    logger.warning("request %s: its step results could not be applied", chunk.request_id, exc_info=True)
                    why = describe("its step results could not be applied", e)
            self.fail_request(chunk.request_id, why)
        self.drafts.observe(scheduled, result)  # the runner's guesses for the next step
        return changed

    def _update_one(self, request: Request, chunk: ScheduledChunk, result: StepOutput, now: float) -> None:
        """One request's part of a step: its computed tokens, its new tokens, its stop."""
        prompt = len(request.prompt_token_ids)
        if request.num_computed_tokens < prompt:
            self.num_prompt_tokens += min(len(chunk.token_ids), prompt - chunk.start_position)
        sampled = result.sampled.get(chunk.request_id, ())
        if chunk.num_draft_tokens:
            self._verified(request, chunk, len(sampled))
        elif chunk.num_steps > 1:  # its token and each sampled one but the last went through the model
            request.num_computed_tokens += max(1, len(sampled))
        else:
            request.num_computed_tokens += len(chunk.token_ids)
            self._cache(request)
        if not chunk.sample:
            return
        if request.pooling is not None:  # its prompt is computed: the runner pooled it, and it is done
            request.times.finished = now
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            return
        if not request.output_token_ids and sampled:
            self._release(request.request_id)  # its prompt is computed, and cached
        for token in sampled:
            request.output_token_ids.append(token)
            self.num_generated_tokens += 1
            if request.times.first_token is None:
                request.times.first_token = now
            status, reason = self._check_stop(request, token)
            if status is not None:
                request.times.finished = now
                self.finish_request(request.request_id, status, reason)
                break
        if (chunk.num_draft_tokens or chunk.num_steps > 1) and request.status is RequestStatus.RUNNING:
            self._cache(request)  # (the accepted drafts, or the steps' tokens, are its tokens now: their blocks hash)

    def _cache(self, request: Request) -> None:
        """Hash and cache the blocks its computed tokens fill, those not cached yet."""
        kv = self.kv
        if kv.enable_prefix_caching:
            full = request.num_computed_tokens // kv.block_size
            if full > kv.num_hashed_blocks(request.request_id):
                kv.cache_blocks(request.request_id, self._block_hashes(request, full))

    def _verified(self, request: Request, chunk: ScheduledChunk, num_sampled: int) -> None:
        """A chunk of drafts came back with `num_sampled` tokens: the accepted drafts and one of the
        target's own. Its last token and the accepted drafts are computed; the blocks that hold only
        rejected drafts' slots go back (past the one the next token lands in; the runner then gets the
        table anew)."""
        accepted = num_sampled - 1
        request.num_computed_tokens += 1 + accepted
        count_positions(request.spec_reached, request.spec_kept, chunk.num_draft_tokens, accepted)
        self.spec.record(chunk.num_draft_tokens, accepted)
        if self.kv.trim(request.request_id, request.num_computed_tokens + 1):
            request.num_sent_blocks = 0

    def advance_decodes(self, steps: int, sampled: dict[str, int]) -> None:
        """`steps` decode steps of the whole running batch at once, each request appending its token of
        `sampled` that many times: the state as many rounds of `schedule` and `update` would leave (as
        many KV blocks, if not the same ids; every block that fills hashed and cached). For a simulator
        that has made sure nothing else would happen in those rounds: every running request decodes one
        token a step and none finishes, no drafts, the free blocks cover them, no waiting request could
        be admitted."""
        for request in self.running:
            computed = request.num_computed_tokens + steps
            if not self.kv.allocate(request.request_id, computed):
                raise ValueError(f"advance_decodes: no KV blocks for {steps} steps of {request.request_id}")
            request.num_computed_tokens = computed
            request.output_token_ids.extend([sampled[request.request_id]] * steps)
            self._cache(request)
            request.num_sent_blocks = len(self.kv.block_table(request.request_id))
        self.num_generated_tokens += steps * len(self.running)

    def _check_stop(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if token in request.eos_token_ids and (not params.ignore_eos or params.structured_outputs is not None):
            # (a grammar allows EOS only where its structure is complete: it ends the request)
            return RequestStatus.FINISHED_STOPPED, None
        output = len(request.output_token_ids)
        if output >= request.max_tokens or len(request.prompt_token_ids) + output >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def stats(self, weight_bytes: int) -> EngineStats:
        """The gauges and totals; `weight_bytes` (the model's, which the scheduler does not see) passes through."""
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting) + sum(len(h) for h in self.held.values()),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            preemptions=self.num_preemptions,
            aborted=self.num_aborted,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            prefix_cache_evictions=self.kv.pool.num_evictions,
            weight_bytes=weight_bytes,
            kv_tokens=self.kv.num_blocks * self.kv.block_size,
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec.accepted_per_pos),
        )
