"""The probe checked against the trace itself: a slice of the trace run for real, each of its steps priced
by the cost model, and the model scaled by what the slice measured.

The probe times steps in isolation, each shape a few times in a row; a run of the trace is not like
that (steps of every shape follow each other, many requests' KV in use, outputs processed), so the
probe tends to price a run's steps a little low (the factors below come out at or a little above 1;
benchmarks/doctor_sim.py records them), which a saturated replica turns into a larger TTFT error (its
queue carries every step's shortfall forward). `calibrate` runs the first requests of the
trace (CALIBRATION_REQUESTS, at the trace's arrival times or rate) on the engine through
`bench.offline.run_offline`, records every step with `StepLog`, and returns the cost model with its
decode terms scaled by the measured over the predicted time of the slice's decode-only steps and its
other terms by the same over its other steps (a factor stays 1 where the slice had fewer than
MIN_STEPS such steps).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import Workload
from tokenmill.doctor.step_cost import AFTER_DECAY_STEPS, CostModel, Heartbeat, StepCost, after_prompt, step_chunks

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

CALIBRATION_REQUESTS = 16
MIN_STEPS = 8


@dataclass
class LoggedStep:
    chunks: list[tuple[int, int]]  # (query length, start position) of each chunk, as the simulator sees them
    decoding: bool  # every chunk decodes one token
    seconds: float  # the whole `LLMEngine.step`
    after: tuple[int, int] = (0, 0)  # (tokens of the last step before that ran prompt tokens, decode steps since)


class StepLog:
    """Every step `engine` runs from now on, as a `LoggedStep`: its `schedule` and `step` wrapped. A step
    that ran several decode forwards in a row (`--decode-steps`) is logged as that many steps of its time
    shared out, so calibration sees what the run saves against the probe's step a forward."""

    def __init__(self, engine: LLMEngine, heartbeat: Callable[[], None] | None = None) -> None:
        """`heartbeat`: called after each step (the calibration's progress)."""
        self.steps: list[LoggedStep] = []
        scheduler = engine.core.scheduler
        schedule, step = scheduler.schedule, engine.step
        pending: list[tuple[list[tuple[int, int]], bool]] = []

        def logged_schedule(now: float) -> Any:
            out = schedule(now)
            pending.append(step_chunks(out, scheduler.requests))  # (before the step: requests still there)
            return out

        def logged_step() -> Any:
            start = time.perf_counter()
            outputs = step()
            seconds = time.perf_counter() - start
            if pending and pending[-1][0]:
                chunks, decoding = pending[-1]
                forwards = engine.last_step.decode_steps  # (a run: decodes only, each a token a forward)
                for i in range(forwards):  # a run as the simulator steps it: a forward a step
                    ahead = [(q, s + i) for q, s in chunks]
                    self.steps.append(LoggedStep(ahead, decoding, seconds / forwards, self._after()))
            pending.clear()
            if heartbeat is not None:
                heartbeat()
            return outputs

        scheduler.schedule = logged_schedule  # type: ignore[method-assign]
        engine.step = logged_step  # type: ignore[method-assign]
        self._wrapped = (scheduler, engine)

    def _after(self) -> tuple[int, int]:
        """The next step's `LoggedStep.after`, from the steps logged so far ((0, n) past the term's reach)."""
        for since, s in enumerate(reversed(self.steps[-AFTER_DECAY_STEPS - 1 :])):
            if not s.decoding:
                return sum(q for q, _ in s.chunks), since
        return 0, min(len(self.steps), AFTER_DECAY_STEPS + 1)

    def close(self) -> None:
        """Stop logging: the engine's own `schedule` and `step` back (the wrappers were instance attributes)."""
        scheduler, engine = self._wrapped
        del scheduler.schedule, engine.step

    def measured_over_predicted(self, cost: CostModel) -> dict[str, tuple[float, int]]:
        """For decode-only steps, the others and all: (summed measured time / summed predicted, steps)."""
        sums: dict[str, list[float]] = {"decode": [0.0, 0.0, 0], "other": [0.0, 0.0, 0], "all": [0.0, 0.0, 0]}
        for s in self.steps:
            for kind in ("decode" if s.decoding else "other", "all"):
                sums[kind][0] += s.seconds
                sums[kind][1] += cost.predict(s.chunks, s.decoding) + (
                    after_prompt(cost, *s.after) if s.decoding else 0.0
                )
                sums[kind][2] += 1
        return {k: (measured / predicted, int(n)) for k, (measured, predicted, n) in sums.items() if predicted > 0}


def scaled(cost: StepCost, decode: float, other: float) -> StepCost:
    """`cost` with its decode-only terms times `decode` and the rest times `other`."""
    return dataclasses.replace(
        cost,
        decode_seconds=[t * decode for t in cost.decode_seconds],
        per_decode_key=cost.per_decode_key * decode,
        prompt_seconds=[t * other for t in cost.prompt_seconds],
        per_request=cost.per_request * other,
        per_prompt_pair=cost.per_prompt_pair * other,
        per_mixed_key=cost.per_mixed_key * other,
        after_prompt_seconds=[t * decode for t in cost.after_prompt_seconds],  # (decode steps': the decay kept)
        calibration={"decode": decode, "other": other},
    )


def calibrate(
    engine: LLMEngine,
    workload: Workload,
    cost: StepCost,
    request_rate: float | None,
    progress: Callable[[str], None] | None = None,
) -> StepCost:
    """`cost` scaled to what the trace's first requests measured on `engine` (idle, and left so: its prefix
    cache emptied after); `progress` told when it starts, the steps run every HEARTBEAT_S seconds, and
    what it found."""
    start = time.perf_counter()
    log = run_head(engine, workload, request_rate, progress)
    return rescaled(log, cost, progress, time.perf_counter() - start)


def run_head(
    engine: LLMEngine, workload: Workload, request_rate: float | None, progress: Callable[[str], None] | None = None
) -> StepLog:
    """The trace's first CALIBRATION_REQUESTS run for real on `engine` (idle, and left so: its prefix cache
    emptied after), every step logged; `progress` told when it starts and the steps run every HEARTBEAT_S."""
    if engine.has_unfinished_requests():
        raise ValueError("engine: busy; the calibration needs an idle engine")
    head = Workload(workload.spec, workload.requests[:CALIBRATION_REQUESTS])
    start = time.perf_counter()
    if progress is not None:
        tokens = sum(len(r.token_ids(engine.tokenizer)) + r.max_tokens for r in head.requests)
        progress(f"calibrating: the trace's first {len(head.requests)} requests ({tokens} tokens) run for real ...")
    pulse = Heartbeat(progress) if progress is not None else None

    def beat() -> None:
        if pulse is not None:
            pulse.beat(lambda: f"calibrating ({time.perf_counter() - start:.0f} s): {len(log.steps)} forwards run")

    log = StepLog(engine, beat)
    try:
        run_offline(engine, head, "doctor-calibration", request_rate=request_rate)
    finally:
        log.close()
    engine.reset_prefix_cache()
    return log


def rescaled(
    log: StepLog, cost: StepCost, progress: Callable[[str], None] | None = None, seconds: float | None = None
) -> StepCost:
    """`cost` scaled by what the logged steps measured over what it gives them (decode-only steps and the
    others apart; a factor 1 where fewer than MIN_STEPS such steps were logged); `progress` told the factors
    (and the `seconds` the run took)."""
    ratios = log.measured_over_predicted(cost)
    factors = {k: ratios[k][0] if k in ratios and ratios[k][1] >= MIN_STEPS else 1.0 for k in ("decode", "other")}
    if progress is not None:
        progress(
            f"calibrated on {len(log.steps)} steps{'' if seconds is None else f' in {seconds:.0f} s'}: decode "
            f"x{factors['decode']:.2f}, others x{factors['other']:.2f}"
        )
    return scaled(cost, factors["decode"], factors["other"])
