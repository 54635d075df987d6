"""The offline load generator: a workload through an in-process `LLMEngine`, timed per token.

Requests are added when due (all at once by default, Poisson arrivals with a request rate, or
closed loop under a concurrency cap; multi-turn turns when their previous turn finishes) and the
engine is stepped until all are done. A token's arrival is the end of the engine step that produced
it, so TTFT, ITL and end-to-end latency are what an in-process caller sees. Besides the request
records, a run reports what only the engine knows: the share of allocated KV slots holding live
tokens, the time per step outside the model forward with a full batch decoding, preemptions and
prefix-cache hits. The clock and the sleep between arrivals can be injected (a test's fake time);
they default to `time.perf_counter` and `time.sleep`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.bench.records import RequestRecord, Run
from tokenmill.bench.workloads import BenchRequest, Workload, send_times
from tokenmill.outputs import OutputKind
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.outputs import EngineStats, RequestOutput, StepStats


class SteppedEngine(Protocol):
    """What a run drives: an `LLMEngine`, or the doctor's simulator in its place."""

    config: EngineConfig
    tokenizer: Any

    @property
    def last_step(self) -> StepStats: ...
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, output_kind: OutputKind
    ) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> EngineStats: ...
    def has_unfinished_requests(self) -> bool: ...


def run_offline(
    engine: SteppedEngine,
    workload: Workload,
    label: str,
    repeat: int = 0,
    settings: dict[str, Any] | None = None,
    request_rate: float | None = None,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> Run:
    """One pass of `workload` through `engine` (which must be idle); every request ends finished or failed."""
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; a benchmark run needs an idle engine")
    reqs = workload.requests
    due = send_times(reqs, request_rate, workload.spec.seed)
    pending = deque(sorted((i for i, t in enumerate(due) if t is not None), key=lambda i: (due[i], i)))
    dependents: dict[int, list[int]] = {}
    for r in reqs:
        if r.after is not None:
            dependents.setdefault(r.after, []).append(r.index)
    ready: deque[tuple[int, float]] = deque()  # (dependent, when its previous turn finished)
    records: dict[int, RequestRecord] = {}
    in_flight: dict[str, RequestRecord] = {}
    last_token: dict[str, float] = {}
    before = engine.stats()
    live = allocated = 0
    full_steps: list[tuple[float, float]] = []  # (total, outside the forward) with a full batch decoding
    full = engine.config.max_num_seqs
    slot_free_at = 0.0  # with a concurrency cap: when a slot last opened
    t0 = clock()

    def add(index: int, arrived: float) -> None:
        # A request starts when it arrived (and, under a cap, a slot was free), as a server would have
        # received it, even if the engine was mid-step then: that wait is part of its latency.
        start = arrived if max_concurrency is None else max(arrived, slot_free_at)
        record = RequestRecord(index=index, ok=False, start_s=start)
        records[index] = record
        request_id = f"bench-{repeat}-{index}"
        try:
            engine.add_request(
                request_id,
                reqs[index].token_ids(engine.tokenizer),
                _params(reqs[index], ignore_eos),
                output_kind=OutputKind.DELTA,  # new tokens only: no copy of the whole output each step
            )
        except ValueError as e:
            record.error = f"refused: {e}"
            ready.extend((d, start) for d in dependents.get(index, []))
            return
        in_flight[request_id] = record

    while pending or ready or in_flight:
        now = clock() - t0
        while (ready or (pending and due[pending[0]] <= now)) and (  # type: ignore[operator]
            max_concurrency is None or len(in_flight) < max_concurrency
        ):
            if ready:
                add(*ready.popleft())
            else:
                index = pending.popleft()
                add(index, due[index])  # type: ignore[arg-type]
        if not in_flight:
            if pending:
                sleep(max(0.0, due[pending[0]] - (clock() - t0)))  # type: ignore[operator]
            continue
        outputs = engine.step()
        now = clock() - t0
        step = engine.last_step
        live += step.kv_live_tokens
        allocated += step.kv_allocated_slots
        if step.num_running == full and step.num_batched_tokens == full:
            full_steps.append((step.total_seconds, step.total_seconds - step.forward_seconds))
        for out in outputs:
            record = in_flight[out.request_id]
            completion = out.outputs[0] if out.outputs else None
            if completion is not None and completion.token_ids:  # one arrival, however many tokens
                if record.ttft_s is None:
                    record.ttft_s = now - record.start_s
                else:
                    record.itl_s.append(now - last_token[out.request_id])
                last_token[out.request_id] = now
                record.output_tokens += len(completion.token_ids)
            if out.finished:
                del in_flight[out.request_id]
                last_token.pop(out.request_id, None)
                record.ok = completion is not None and completion.finish_reason != "abort"
                record.error = None if record.ok else "aborted"
                record.e2e_s = now - record.start_s
                record.prompt_tokens = len(out.prompt_token_ids)
                record.cached_tokens = out.num_cached_tokens
                ready.extend((d, now) for d in dependents.get(record.index, []))
                slot_free_at = now
    duration = clock() - t0
    after = engine.stats()
    extras: dict[str, Any] = {
        "kv_live_share": live / allocated if allocated else None,
        "preemptions": after.preemptions - before.preemptions,
        "prefix_cache_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        **{
            name: getattr(after, name) - getattr(before, name)
            for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        },
        "full_decode_steps": len(full_steps),
    }
    if extras["spec_decode_num_draft_tokens"]:  # speculative decoding ran: how well its drafts did
        extras["spec_decode_acceptance_rate"] = (
            extras["spec_decode_num_accepted_tokens"] / extras["spec_decode_num_draft_tokens"]
        )
        extras["spec_decode_mean_accepted_length"] = (
            1 + extras["spec_decode_num_accepted_tokens"] / extras["spec_decode_num_drafts"]
        )
    if full_steps:
        extras["full_decode_step_ms"] = statistics.median(s for s, _ in full_steps) * 1e3
        extras["full_decode_overhead_ms"] = statistics.median(o for _, o in full_steps) * 1e3
        extras["full_decode_overhead_share"] = extras["full_decode_overhead_ms"] / extras["full_decode_step_ms"]
    ordered = [records[i] for i in sorted(records)]
    return Run(label, repeat, dict(settings or {}), duration, ordered, extras={k: v for k, v in extras.items()})


def _params(request: BenchRequest, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=ignore_eos)
