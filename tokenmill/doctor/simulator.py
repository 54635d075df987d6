"""The trace-replay simulator: the engine's own scheduler and KV manager, a cost model instead of the model.

`SimulatedEngine` stands in for an `LLMEngine` wherever one is driven step by step (`bench.offline.
run_offline` takes it as it is, with the simulator's clock and sleep): requests go to the real
`Scheduler` (or `StaticScheduler`) over a real `KVManager` of the block count a setting gives, each step
runs the scheduler's own rule (admission, chunked prompts, prefix-cache hits, preemption), and instead
of a forward the simulated clock moves on by what `StepCost` predicts for the step's chunks. Every
sampling chunk "samples" a token (a negative id of its own per request, which no prompt holds: the
outputs' blocks take room and hash as real ones do, and never match a prompt). Requests generate
max_tokens tokens (as with ignore_eos), so a trace states each request's output length as max_tokens.
The result is the run's records, as a measured run's: TTFT, TPOT, throughput and KV use, for any
setting, in a fraction of the time the run would take (a discrete-event simulation, as Vidur's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.doctor.step_cost import CostModel, step_chunks
from tokenmill.outputs import (
    CompletionOutput,
    EngineStats,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    StepOutput,
    StepStats,
)
from tokenmill.request import Request, RequestStatus, RequestTimes
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.kv_manager import KVManager
from tokenmill.sched.scheduler import Scheduler, SchedulerConfig
from tokenmill.sched.static import StaticScheduler


@dataclass
class SimulatedSteps:
    """What the simulated run's steps did, for the report."""

    steps: int = 0
    busy_seconds: float = 0.0  # simulated time spent in steps
    peak_blocks: int = 0  # the most KV blocks held at once
    live_tokens: int = 0  # summed over steps: tokens whose KV is live
    allocated_slots: int = 0  # summed over steps: slots in the blocks held
    decode_only_steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests in each step


class SimulatedEngine:
    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, cost: CostModel, weight_bytes: int = 0
    ) -> None:
        self.config = config
        self.cost = cost
        self.max_model_len = max_model_len
        self.weight_bytes = weight_bytes
        kv = KVManager(
            num_blocks,
            config.block_size,
            watermark_blocks=max(1, num_blocks // 100),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        scheduler_cls = StaticScheduler if config.scheduling == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), kv
        )
        self.now = 0.0
        self.last_step = StepStats(0, 0, 0.0, 0.0, 0, 0)
        self.record = SimulatedSteps()
        self.tokenizer = None  # prompts come as token ids
        self._reported: dict[str, int] = {}  # request -> output tokens already returned
        self._token: dict[str, int] = {}  # request -> the token id its simulated outputs carry

    # -- the simulated clock (run_offline's `clock` and `sleep`) ----------------------------------

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    # -- LLMEngine's interface, as run_offline uses it --------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> None:
        if isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: the simulator takes a non-empty list of token ids")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room under max_model_len {self.max_model_len}")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            seed=0,
            max_tokens=min(params.max_tokens or room, room),
            eos_token_ids=(),
            times=RequestTimes(arrival=self.now if arrival_time is None else arrival_time),
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        self._reported[request_id] = 0
        self._token[request_id] = -1 - len(self._token)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return self.scheduler.stats(self.weight_bytes)

    def step(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        scheduled = scheduler.schedule(self.now)
        chunks, decoding = step_chunks(scheduled, scheduler.requests)
        seconds = self.cost.predict(chunks, decoding) if chunks else 0.0
        self.now += seconds
        result = StepOutput()
        for c in scheduled.chunks:
            if c.sample:
                result.sampled[c.request_id] = [self._token[c.request_id]]
        changed = scheduler.update(scheduled, result, self.now)
        kv = scheduler.kv
        live = sum(r.num_computed_tokens for r in scheduler.running)
        tokens = sum(q for q, _ in chunks)
        self.last_step = StepStats(len(chunks), tokens, seconds, seconds, live, kv.num_allocated_slots())
        rec = self.record
        rec.steps += 1
        rec.busy_seconds += seconds
        rec.peak_blocks = max(rec.peak_blocks, kv.num_blocks - kv.num_free_blocks)
        rec.live_tokens += live
        rec.allocated_slots += self.last_step.kv_allocated_slots
        rec.decode_only_steps += bool(chunks) and decoding
        rec.batch_sizes.append(len(chunks))
        return [self._output(r) for r in changed]

    def _output(self, request: Request) -> RequestOutput:
        had = self._reported[request.request_id]
        new = request.output_token_ids[had:]
        self._reported[request.request_id] = len(request.output_token_ids)
        finished = request.status.finished
        reason = None
        if finished:
            reason = {RequestStatus.FINISHED_LENGTH: "length", RequestStatus.FINISHED_ABORTED: "abort"}.get(
                request.status, "stop"
            )
        times = request.times
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[CompletionOutput(0, "", list(new), None, reason)],
            finished=finished,
            metrics=RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished),
            num_cached_tokens=request.num_cached_tokens,
        )
