"""The offline load generator: a workload through an in-process `LLMEngine`, timed per token.

Requests are added when due (all at once by default, Poisson arrivals with a request rate, or
closed loop under a concurrency cap; multi-turn turns when their previous turn finishes) and the
engine is stepped until all are done. A token's arrival is the end of the engine step that produced
it, so TTFT, ITL and end-to-end latency are what an in-process caller sees. Besides the request
records, a run reports what only the engine knows: the share of allocated KV slots holding live
tokens, the time per step outside the model forward with a full batch decoding, preemptions and
prefix-cache hits. The clock and the sleep between arrivals can be injected (a test's fake time);
they default to `time.perf_counter` and `time.sleep`. `until`, told each request's record as it
finishes, may end a run early (the doctor's capacity search, once a replay's SLOs are settled).
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
    until: Callable[[RequestRecord], bool] | None = None,
) -> Run:
    """One pass of `workload` through `engine` (which must be idle); every request ends finished or failed.
    `until(record)`, called as each request finishes, True: the run ends there (only a stepped engine
    that can be dropped, as the doctor's simulator: its requests in flight are left as they are, their
    records failed as not finished, those not yet sent without one; `extras["stopped"]` says so)."""
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; a benchmark run needs an idle engine")
    due = send_times(workload.requests, request_rate, workload.spec.seed)
    run = _Pass(engine, workload.requests, due, repeat, max_concurrency, ignore_eos)
    run.until = until
    before = engine.stats()
    t0 = clock()
    while (run.pending or run.ready or run.in_flight) and not run.stopped:
        run.admit(clock() - t0)
        if not run.in_flight:
            if run.pending:
                sleep(max(0.0, run.next_due() - (clock() - t0)))
            continue
        outputs = engine.step()
        run.account(engine.last_step, outputs, clock() - t0)
    duration = clock() - t0
    extras = _extras(before, engine.stats(), run)
    if run.stopped and (run.pending or run.ready or run.in_flight):  # (stopped at the last request: a whole run)
        extras["stopped"] = True
        for record in run.in_flight.values():
            record.error = "not finished: the run was stopped early"
    ordered = [run.records[i] for i in sorted(run.records)]
    return Run(label, repeat, dict(settings or {}), duration, ordered, extras=extras)


class _Pass:
    """The state of one run: requests due, waiting on a previous turn, in flight, and their records."""

    def __init__(
        self,
        engine: SteppedEngine,
        reqs: list[BenchRequest],
        due: list[float | None],
        repeat: int,
        max_concurrency: int | None,
        ignore_eos: bool,
    ) -> None:
        self.engine, self.reqs, self.due, self.repeat = engine, reqs, due, repeat
        self.max_concurrency, self.ignore_eos = max_concurrency, ignore_eos
        self.pending = deque(sorted((i for i, t in enumerate(due) if t is not None), key=lambda i: (due[i], i)))
        self.dependents: dict[int, list[int]] = {}
        for r in reqs:
            if r.after is not None:
                self.dependents.setdefault(r.after, []).append(r.index)
        self.ready: deque[tuple[int, float]] = deque()  # (dependent, when its previous turn finished)
        self.records: dict[int, RequestRecord] = {}
        self.in_flight: dict[str, RequestRecord] = {}
        self.last_token: dict[str, float] = {}
        self.live = self.allocated = 0
        self.full_steps: list[tuple[float, float]] = []  # (total, outside the forward) with a full batch decoding
        self.slot_free_at = 0.0  # with a concurrency cap: when a slot last opened
        self.until: Callable[[RequestRecord], bool] | None = None  # run_offline's
        self.stopped = False  # `until` ended the run

    def next_due(self) -> float:
        due = self.due[self.pending[0]]
        assert due is not None
        return due

    def admit(self, now: float) -> None:
        """Add every request that is due (or whose previous turn finished) while a slot is free."""
        while (self.ready or (self.pending and self.next_due() <= now)) and (
            self.max_concurrency is None or len(self.in_flight) < self.max_concurrency
        ):
            if self.ready:
                self._add(*self.ready.popleft())
            else:
                self._add(self.pending[0], self.next_due())
                self.pending.popleft()

    def _add(self, index: int, arrived: float) -> None:
        # A request starts when it arrived (and, under a cap, a slot was free), as a server would have
        # received it, even if the engine was mid-step then: that wait is part of its latency.
        start = arrived if self.max_concurrency is None else max(arrived, self.slot_free_at)
        record = RequestRecord(index=index, ok=False, start_s=start)
        self.records[index] = record
        request_id = f"bench-{self.repeat}-{index}"
        try:
            self.engine.add_request(
                request_id,
                self.reqs[index].token_ids(self.engine.tokenizer),
                _params(self.reqs[index], self.ignore_eos),
                output_kind=OutputKind.DELTA,  # new tokens only: no copy of the whole output each step
            )
        except ValueError as e:
            record.error = f"refused: {e}"
            self.ready.extend((d, start) for d in self.dependents.get(index, []))
            return
        self.in_flight[request_id] = record

    def account(self, step: StepStats, outputs: list[RequestOutput], now: float) -> None:
        """Record one step: its KV use, its time with a full batch, and every token and finish it produced."""
        self.live += step.kv_live_tokens
        self.allocated += step.kv_allocated_slots
        full = self.engine.config.max_num_seqs
        if step.num_running == full and step.num_batched_tokens == full:  # (a run of decode steps: per forward)
            n = step.decode_steps
            self.full_steps.append((step.total_seconds / n, (step.total_seconds - step.forward_seconds) / n))
        for out in outputs:
            record = self.in_flight[out.request_id]
            completion = out.outputs[0] if out.outputs else None
            if completion is not None and completion.token_ids:  # one arrival, however many tokens
                if record.ttft_s is None:
                    record.ttft_s = now - record.start_s
                else:
                    record.itl_s.append(now - self.last_token[out.request_id])
                self.last_token[out.request_id] = now
                record.output_tokens += len(completion.token_ids)
            if out.finished:
                del self.in_flight[out.request_id]
                self.last_token.pop(out.request_id, None)
                record.ok = completion is not None and completion.finish_reason != "abort"
                record.error = None if record.ok else "aborted"
                record.e2e_s = now - record.start_s
                record.prompt_tokens = len(out.prompt_token_ids)
                record.cached_tokens = out.num_cached_tokens
                self.ready.extend((d, now) for d in self.dependents.get(record.index, []))
                self.slot_free_at = now
                if self.until is not None and self.until(record):
                    self.stopped = True


def _extras(before: EngineStats, after: EngineStats, run: _Pass) -> dict[str, Any]:
    """What only the engine knows about the run: KV use, preemptions, prefix hits, drafts, full-batch steps."""
    extras: dict[str, Any] = {
        "kv_live_share": run.live / run.allocated if run.allocated else None,
        "preemptions": after.preemptions - before.preemptions,
        "prefix_cache_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        **{
            name: getattr(after, name) - getattr(before, name)
            for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        },
        "full_decode_steps": len(run.full_steps),
    }
    if extras["spec_decode_num_draft_tokens"]:  # speculative decoding ran: how well its drafts did
        extras["spec_decode_acceptance_rate"] = (
            extras["spec_decode_num_accepted_tokens"] / extras["spec_decode_num_draft_tokens"]
        )
        extras["spec_decode_mean_accepted_length"] = (
            1 + extras["spec_decode_num_accepted_tokens"] / extras["spec_decode_num_drafts"]
        )
    if run.full_steps:
        extras["full_decode_step_ms"] = statistics.median(s for s, _ in run.full_steps) * 1e3
        extras["full_decode_overhead_ms"] = statistics.median(o for _, o in run.full_steps) * 1e3
        extras["full_decode_overhead_share"] = extras["full_decode_overhead_ms"] / extras["full_decode_step_ms"]
    return extras


def _params(request: BenchRequest, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=ignore_eos)
