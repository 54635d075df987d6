"""EngineCore: token ids in, plain messages out — schedule -> execute -> update, once per step.

Owns the scheduler (and through it the KV manager) and the worker that runs the model. The step has
no feature branches: speculative decoding is the scheduler's draft policy (which requests take
drafts) and the runner's proposer (the guesses, handed back in `StepOutput`); KV transfer is a
connector the scheduler and the worker call at their edges. The core only puts them together. It takes
`EngineCoreRequest`s, aborts and stops (a stop string the front end matched: the request finishes
as stopped and its blocks are freed here, in the core, like every other finish), and each `step()`
returns `EngineCoreOutputs`: per request that changed, the new token ids and logprobs, the
prompt-logprob rows of the chunk just run, the finish and stop reason, cached tokens and timestamps.
It never tokenizes, detokenizes or fans out `n`: the front end (`OutputProcessor`) does.

Faults stay as small as they can: an error that belongs to one request (its logits processors, its
grammar, its KV allocation, its stop check) fails that request alone, and one in the step itself
(the forward) fails the step's requests; either way they finish with `finish_reason` "error" and a
`fault` saying why, their blocks freed, and the core goes on serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tokenmill.errors import ParamError, describe
from tokenmill.outputs import EngineStats, SchedulerOutput, StepOutput, StepStats
from tokenmill.request import Request, RequestStatus, RequestTimes
from tokenmill.runner.worker import Worker
from tokenmill.sched.draft_policy import Drafting, NoDrafts
from tokenmill.sched.kv_connector import KVConnector, KVTransfer
from tokenmill.sched.kv_manager import KVManager
from tokenmill.sched.scheduler import Scheduler, SchedulerConfig
from tokenmill.sched.static import StaticScheduler

logger = logging.getLogger("tokenmill")


class EngineCore:
    def __init__(self, config: EngineConfig, kv_connector: KVTransfer | None = None) -> None:
        """`kv_connector`: where KV computed elsewhere comes in and a finished prefill's goes out
        (prefill/decode disaggregation), handed to the scheduler and the worker, never called here;
        None for a core that serves requests whole."""
        self.config = config
        if kv_connector is not None and config.speculative_config:
            raise ValueError("speculative_config: not with prefill/decode disaggregation (the draft's KV stays behind)")
        self.worker = Worker(config, kv_connector)
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.block_size = self.worker.block_size
        self.num_blocks = self.worker.num_blocks
        self.scheduler = make_scheduler(config, self.num_blocks, self.max_model_len, kv_connector)
        self.last_step = StepStats(0, 0, 0.0, 0.0, 0, 0)
        self.num_step_failures = 0

    # -- requests in -----------------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a ValueError (naming the field) if it can never run here. A request with
        `kv_transfer.output_token_ids` continues after them (its KV handed to the KV connector before);
        one with `kv_transfer.send` keeps its prompt's KV for another engine. A structured-output
        request's grammar is compiled here (once per spec), not in a step."""
        moved = req.kv_transfer
        spec = req.sampling_params.structured_outputs
        grammar = self.worker.runner.batch.grammar
        if spec is not None:  # compiled now, between steps (cached): the step only copies the matcher
            if grammar is None:
                raise ParamError("structured_outputs", "structured_outputs: this engine has no grammar support")
            grammar.compiler.check(spec)
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            seed=req.seed,
            max_tokens=req.max_tokens,
            eos_token_ids=tuple(req.eos_token_ids),
            times=RequestTimes(arrival=req.arrival_time),
            cache_salt=req.cache_salt,
            output_token_ids=list(moved.output_token_ids) if moved is not None else [],
            send_kv=moved is not None and moved.send,
            pooling=req.pooling,
        )
        wait_for = req.wait_for if self.config.enable_prefix_caching else None
        self.scheduler.add_request(request, wait_for)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish requests whose output matched a stop string (the front end keeps the string)."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(time.monotonic())
        requests = self.scheduler.requests
        had = {c.request_id: len(requests[c.request_id].output_token_ids) for c in scheduled.chunks}
        try:
            result = self.worker.execute(scheduled)
        except Exception as e:  # the step itself failed: its requests fail, the engine goes on
            return self._step_failed(scheduled, e, start)
        changed = self.scheduler.update(scheduled, result, time.monotonic())
        self.worker.after_update()  # (the worker's end of the step: KV a connector sends out)
        return self._step_outputs(scheduled, result, changed, had, start)

    def _step_outputs(
        self, scheduled: SchedulerOutput, result: StepOutput, changed: list[Request], had: dict[str, int], start: float
    ) -> EngineCoreOutputs:
        """The step's outputs: what changed for each request, prompt-logprob rows, failures; its stats."""
        outputs = [self._output(r, result, had[r.request_id]) for r in changed]
        reported = {r.request_id for r in changed}
        for request_id, rows in result.prompt_logprobs.items():  # a prompt chunk that sampled nothing
            if request_id not in reported:
                outputs.append(EngineCoreOutput(request_id, new_prompt_logprobs=rows))
        outputs += self._failures()
        self.last_step = StepStats(
            num_running=len(scheduled.chunks),
            num_batched_tokens=scheduled.num_batched_tokens,
            total_seconds=time.perf_counter() - start,
            forward_seconds=result.forward_seconds,
            kv_live_tokens=sum(r.num_computed_tokens for r in self.scheduler.running),
            kv_allocated_slots=self.scheduler.kv.num_allocated_slots(),
            decode_steps=result.decode_steps,
        )
        return EngineCoreOutputs(outputs, self.stats(), self.last_step)

    def _step_failed(self, scheduled: SchedulerOutput, error: Exception, start: float) -> EngineCoreOutputs:
        """The step's forward (or anything of the runner's that no request owns) failed: its requests
        fail, the runner forgets them, and the next step starts clean."""
        logger.error("engine step failed; its %d requests fail", len(scheduled.chunks), exc_info=error)
        self.num_step_failures += 1
        ids = [c.request_id for c in scheduled.chunks]
        for request_id in ids:
            self.scheduler.fail_request(request_id, describe("the engine step it was in failed", error))
        self.worker.runner.forget([*ids, *scheduled.finished_request_ids])
        elapsed = time.perf_counter() - start
        self.last_step = StepStats(len(ids), scheduled.num_batched_tokens, elapsed, 0.0, 0, 0)
        return EngineCoreOutputs(self._failures(), self.stats(), self.last_step)

    def _failures(self) -> list[EngineCoreOutput]:
        """An output for each request failed since the last step (finished, its blocks free)."""
        now = time.monotonic()
        return [
            EngineCoreOutput(request_id, finish_reason=RequestStatus.FINISHED_ERROR.value, finished_time=now, fault=why)
            for request_id, why in self.scheduler.take_failed().items()
        ]

    def recover(self, error: Exception) -> EngineCoreOutputs:
        """After an error that escaped a step (no request owns it, and the scheduler's state is in
        doubt): every request the core holds fails, the runner forgets them all, and the core serves on."""
        held = len(self.scheduler.requests)
        logger.error("engine step failed outside any one request; the %d requests held fail", held, exc_info=error)
        self.num_step_failures += 1
        why = describe("the engine failed a step", error)
        for request_id in list(self.scheduler.requests):
            self.scheduler.fail_request(request_id, why)
        self.reset()
        return EngineCoreOutputs(self._failures(), self.stats(), self.last_step)

    def reset(self) -> None:
        """Abort whatever requests are left and clear the runner's per-request state: a clean core for a
        new loop (a restart after the old one ended)."""
        self.abort_requests(list(self.scheduler.requests))
        self.worker.runner.forget(list(self.worker.runner.batch.row_of))

    @staticmethod
    def _output(request: Request, result: StepOutput, had: int) -> EngineCoreOutput:
        """What changed for `request` this step; `had`: its output tokens before the step."""
        new = request.output_token_ids[had:]  # those the scheduler kept (none past a stop)
        logprobs = result.logprobs.get(request.request_id)
        stop = request.stop_reason
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(new),
            new_logprobs=logprobs[: len(new)] if logprobs is not None else None,
            new_prompt_logprobs=result.prompt_logprobs.get(request.request_id),
            finish_reason=request.status.value if request.status.finished else None,
            stop_reason=stop if isinstance(stop, int) else None,
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.times.first_scheduled,
            first_token_time=request.times.first_token,
            finished_time=request.times.finished,
            pooled=result.pooled.get(request.request_id),
        )

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats(self.worker.weight_bytes)
        extra = self.worker.stats_fields()  # the structured-output and KV-transfer counters
        return dataclasses.replace(stats, step_failures=self.num_step_failures, **extra)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's reset_prefix_cache); False while requests are in flight."""
        return self.scheduler.kv.reset_prefix_cache()


def make_scheduler(
    config: EngineConfig, num_blocks: int, max_model_len: int, kv_connector: KVConnector | None = None
) -> Scheduler:
    """The scheduler the settings ask for, over a KV manager of `num_blocks` blocks: static batching or
    continuous, with speculative decoding's draft policy where a speculative_config is given."""
    kv = KVManager(
        num_blocks,
        config.block_size,
        watermark_blocks=max(1, num_blocks // 100),
        enable_prefix_caching=config.enable_prefix_caching,
    )
    spec = config.speculative_config
    # (a step of drafts verifies them in one forward; the static baseline stays as it was measured)
    steps = 1 if spec or config.scheduling == "static" else config.decode_steps
    sched_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, steps)
    if config.scheduling == "static":
        return StaticScheduler(sched_config, kv, kv_connector)
    drafts = Drafting(SpeculativeConfig.parse(spec), max_model_len) if spec else NoDrafts()
    return Scheduler(sched_config, kv, kv_connector, drafts)
