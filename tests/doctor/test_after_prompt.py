"""The decode steps right after a prompt step, priced as the engine runs them: the simulator adds
`StepCost.after_prompt` (what the probe measured the first decode step after a prompt step to cost beyond
a steady one, decaying over the next AFTER_DECAY_STEPS) to the decode-only steps that follow a step of
prompt tokens, and to no other; the step log and the calibration price the measured steps the same way.
The replay before this priced every decode step as a steady one: a request with a few output tokens,
whose inter-token gaps are mostly such steps, got a TPOT too short (benchmarks/RESULTS.md, the Azure code
window)."""

from __future__ import annotations

import pytest

from tests.doctor.test_doctor import curve, random_prompts, workload
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import send_times
from tokenmill.config import EngineConfig
from tokenmill.doctor.calibrate import LoggedStep, StepLog, scaled
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.step_cost import AFTER_DECAY_STEPS, StepCost

EXTRA = 4e-3  # what the probe "measured" after a 256-token prompt step: linear from 0 at 0 tokens ...
DECAY = 0.5  # ... and halving each decode step after the first


def dearer_after_prompts(cost: StepCost) -> StepCost:
    cost.after_prompt_tokens, cost.after_prompt_seconds, cost.after_prompt_decay = [256], [EXTRA], DECAY
    return cost


def replay(w, cost: StepCost, fast: bool = True, **settings):
    sim = SimulatedEngine(EngineConfig.from_kwargs("unused", **settings), 400, 2048, cost)
    if fast:
        sim.arrivals = sorted(t for t in send_times(w.requests, None, w.spec.seed) if t is not None)
    return run_offline(sim, w, "sim", clock=sim.clock, sleep=sim.sleep).records


def test_the_decode_steps_after_its_prompt_cost_what_the_probe_measured_and_the_later_ones_do_not():
    cost = dearer_after_prompts(curve())
    steady = cost.decode_step(1, 0)  # (no attention term in this curve)
    (record,) = replay(workload(random_prompts(1, 128, 128), [12]), cost)
    first = EXTRA / 2  # a 128-token prompt step before it
    dearer = [steady + first * DECAY**j for j in range(AFTER_DECAY_STEPS)]
    assert record.itl_s[:AFTER_DECAY_STEPS] == [pytest.approx(t) for t in dearer]
    assert sum(record.itl_s[AFTER_DECAY_STEPS:]) == pytest.approx((11 - AFTER_DECAY_STEPS) * steady)
    assert len(record.itl_s) < 11  # (then fast-forwarded: the steps to come are steady)
    assert record.tpot_s == pytest.approx(steady + first * (1 + 0.5 + 0.25 + 0.125) / 11)
    (old,) = replay(workload(random_prompts(1, 128, 128), [12]), curve())  # the replay before: all steady
    assert old.itl_s[0] == pytest.approx(steady) and old.tpot_s == pytest.approx(steady)


def test_a_neighbours_prompt_chunk_makes_the_next_gap_dearer_too():
    """Request 0 decodes; request 1 arrives, its prompt runs beside 0's decode (a mixed step); 0's next
    decode step is the first after prompt tokens again."""
    cost = dearer_after_prompts(curve())
    w = workload(random_prompts(2, 64, 64), [12, 2], arrivals=[0.0, 0.05])
    first, second = replay(w, cost)
    steady2 = cost.decode_step(2, 0)
    mixed = cost.predict([(1, 70), (64, 0)], decoding=False)
    after_mixed = steady2 + cost.after_prompt(65)
    assert after_mixed > steady2 + EXTRA / 4
    assert second.itl_s == [pytest.approx(after_mixed)]  # its own first gap, priced after the mixed step
    at = first.itl_s.index(pytest.approx(mixed))  # 0's gap holding 1's prompt chunk ...
    assert first.itl_s[at + 1] == pytest.approx(after_mixed)  # ... and the gap after it, dearer
    assert first.itl_s[at + 2] == pytest.approx(cost.decode_step(1, 0) + cost.after_prompt(65) * DECAY)


def test_fast_forward_keeps_the_term_exact():
    cost = dearer_after_prompts(curve(per_token_ms=0.3))
    cost.per_decode_key = 2e-6
    w = workload(random_prompts(30, 5, 300, seed=3), [1, 2, 3, 9, 40] * 6, arrivals=[i * 0.03 for i in range(30)])
    slow, fast = replay(w, cost, fast=False, max_num_seqs=8), replay(w, cost, fast=True, max_num_seqs=8)
    for a, b in zip(slow, fast, strict=True):
        assert (b.ttft_s, b.e2e_s) == (pytest.approx(a.ttft_s, rel=1e-9), pytest.approx(a.e2e_s, rel=1e-9))
    steady = curve(per_token_ms=0.3)
    steady.per_decode_key = 2e-6
    plain = replay(w, steady, max_num_seqs=8)
    assert sum(r.e2e_s for r in fast) > sum(r.e2e_s for r in plain)  # (the term did apply)


def test_the_step_log_and_the_calibration_price_the_step_after_a_prompt_the_same_way():
    cost = dearer_after_prompts(curve())
    log = StepLog.__new__(StepLog)
    prompt, decode = [(256, 0)], [(1, 256)]
    log.steps = [LoggedStep(prompt, False, cost.predict(prompt, False))]
    for j in range(AFTER_DECAY_STEPS + 2):
        assert log._after() == (256, j) or j > AFTER_DECAY_STEPS  # (what the wrapped step records)
        log.steps.append(LoggedStep(decode, True, cost.predict(decode, True) + cost.after_prompt(256, j), (256, j)))
    assert log._after()[0] == 0 and cost.after_prompt(256, AFTER_DECAY_STEPS) == 0.0
    ratios = log.measured_over_predicted(cost)
    assert ratios["decode"][0] == pytest.approx(1.0) and ratios["all"][0] == pytest.approx(1.0)
    assert log.measured_over_predicted(curve())["decode"][0] > 1.05  # the steady price alone: short
    assert scaled(cost, 2.0, 1.0).after_prompt(256) == pytest.approx(2 * EXTRA)  # a decode step's term
