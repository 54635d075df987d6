"""The simulator's fast-forward (stretches of decode steps run as one call) against the same replay step by
step: every request's TTFT, end-to-end time, tokens and cached tokens, and the run's steps, busy time,
peak blocks, KV statistics and preemptions, equal — on traces with arrivals, shared prefixes, a full
batch with a queue, and a KV cache small enough to preempt."""

from __future__ import annotations

import random

import pytest

from tests.doctor.test_doctor import curve, workload
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import send_times
from tokenmill.config import EngineConfig
from tokenmill.doctor.simulator import SimulatedEngine, _ceil_sum, _most_steps, _new_blocks_summed


def replay(w, fast: bool, blocks: int, **settings):
    config = EngineConfig.from_kwargs("unused", **settings)
    cost = curve(per_token_ms=0.3)
    cost.per_decode_key = 2e-6  # (the context matters: steps grow as requests decode)
    sim = SimulatedEngine(config, blocks, 2048, cost)
    if fast:
        sim.arrivals = sorted(t for t in send_times(w.requests, None, w.spec.seed) if t is not None)
    run = run_offline(sim, w, "sim", clock=sim.clock, sleep=sim.sleep)
    assert sim.scheduler.kv.num_free_blocks == blocks  # every block given back
    return run, sim


def traces():
    rng = random.Random(5)
    system = [rng.randrange(5, 4000) for _ in range(64)]
    prompts = [
        (system if i % 3 == 0 else []) + [rng.randrange(5, 4000) for _ in range(rng.randint(5, 200))] for i in range(60)
    ]
    outputs = [rng.choice([1, 2, 7, 40, 130, 300]) for _ in prompts]
    arrivals = sorted(rng.uniform(0, 6) for _ in prompts)
    yield "arrivals, shared prefixes", workload(prompts, outputs, arrivals), 4000, {"max_num_seqs": 16}
    yield "all at once, a queue", workload(prompts, outputs), 4000, {"max_num_seqs": 8}
    yield "a small cache: preemptions", workload(prompts, outputs), 60, {"max_num_seqs": 16}
    yield "no prefix caching", workload(prompts, outputs, arrivals), 300, {"enable_prefix_caching": False}


@pytest.mark.parametrize(
    ("name", "w", "blocks", "settings"), list(traces()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_fast_forward_replays_exactly_what_step_by_step_does(name, w, blocks, settings):
    slow, slow_sim = replay(w, False, blocks, **settings)
    fast, fast_sim = replay(w, True, blocks, **settings)
    assert fast_sim.record.steps == slow_sim.record.steps
    assert len(fast.records) == len(slow.records)
    for a, b in zip(slow.records, fast.records, strict=True):
        assert (a.ok, a.output_tokens, a.prompt_tokens, a.cached_tokens) == (
            b.ok,
            b.output_tokens,
            b.prompt_tokens,
            b.cached_tokens,
        )
        assert b.ttft_s == pytest.approx(a.ttft_s, rel=1e-9, abs=1e-12)
        assert b.e2e_s == pytest.approx(a.e2e_s, rel=1e-9, abs=1e-12)
    r, s = slow_sim.record, fast_sim.record
    assert (s.peak_blocks, s.live_tokens, s.allocated_slots, s.decode_only_steps) == (
        r.peak_blocks, r.live_tokens, r.allocated_slots, r.decode_only_steps,
    )  # fmt: skip
    assert s.batch_sizes == r.batch_sizes and s.busy_seconds == pytest.approx(r.busy_seconds, rel=1e-9)
    assert fast.extras["preemptions"] == slow.extras["preemptions"]
    assert fast.extras["kv_live_share"] == pytest.approx(slow.extras["kv_live_share"], rel=1e-12)
    assert fast.duration_s == pytest.approx(slow.duration_s, rel=1e-9)
    if name == "a small cache: preemptions":
        assert slow.extras["preemptions"] > 0
    assert sum(len(x.itl_s) for x in fast.records) < sum(len(x.itl_s) for x in slow.records)  # it did fuse


def test_the_block_arithmetic_matches_counting():
    for bs in (1, 4, 16):
        for context in range(0, 40):
            held = -(-context // bs) + (context % 3 == 0)  # (sometimes a block more than needed)
            for steps in range(0, 50):
                counted = sum(max(held, -(-(context + j) // bs)) - held for j in range(1, steps + 1))
                assert _new_blocks_summed(context, held, bs, steps) == counted
        assert _ceil_sum(37, bs) == sum(-(-t // bs) for t in range(1, 38))
    contexts, held = [15, 16, 30], [1, 1, 2]
    assert _most_steps(contexts, held, 16, 100, free=0) == 0  # the second request needs a block at once
    for free in range(0, 12):
        k = _most_steps(contexts, held, 16, 100, free)
        need = sum(max(0, -(-(c + k) // 16) - h) for c, h in zip(contexts, held, strict=True))
        more = sum(max(0, -(-(c + k + 1) // 16) - h) for c, h in zip(contexts, held, strict=True))
        assert need <= free and (k == 100 or more > free)
