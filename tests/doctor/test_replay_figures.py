"""The doctor's replays and trace analyses give the figures they gave before they were made faster (issue
46, item 5): a planted trace (shared system prompts, one-token and long outputs, Poisson-like arrivals, a
few follow-up turns) replayed at the settings the six questions weigh (static batching, the prefix
cache off, a smaller step budget, a cache small enough to preempt, an ample one, decode-only steps,
Poisson rates, the whole trace at once), its LRU prefix-hit replays, question 2's prefix analyses and
its prompt-lookup agreement, each figure against data/replay_figures.json, written by the code before
the speed-ups (`python -m tests.doctor.test_replay_figures --write` writes it anew: only for a change
meant to move them)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.doctor.test_doctor import curve
from tokenmill.bench.workloads import BenchRequest, Workload, WorkloadSpec
from tokenmill.config import EngineConfig
from tokenmill.doctor.diagnose import Replays
from tokenmill.doctor.latency import lookup_agreement
from tokenmill.doctor.prefix_report import TraceRequest, analyse, replay_kv_cache
from tokenmill.doctor.redundancy import _sharing
from tokenmill.doctor.scale import DecodeOnlyCost

FIGURES = Path(__file__).parent / "data" / "replay_figures.json"
STATS = ("mean", "median", "p90", "p99", "min", "max")
SETTINGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("current", {}, {}),
    ("static", {"scheduling": "static"}, {}),
    ("no prefix cache", {"enable_prefix_caching": False}, {}),
    ("budget 64", {"max_num_batched_tokens": 64}, {}),
    ("120 blocks: preemptions", {}, {"num_blocks": 120}),
    ("ample blocks", {}, {"num_blocks": 10**5}),
    ("decode-only steps", {}, {"cost": "decode-only"}),
    ("Poisson 5/s", {}, {"request_rate": 5.0}),
    ("all at once", {}, {"request_rate": math.inf}),
]
NAMES = [name for name, _, _ in SETTINGS] + ["lru hits", "analyse", "sharing", "lookup"]


def planted() -> Workload:
    """150 requests: a third behind one of two system prompts, outputs from 1 to 300 tokens, arrivals
    at about 10 a second (a queue forms at times), every tenth a second turn sent when the one before finished."""
    rng = random.Random(46)
    systems = [[rng.randrange(5, 4000) for _ in range(n)] for n in (80, 200)]
    requests, t = [], 0.0
    for i in range(150):
        prompt = (systems[i % 2] if i % 3 == 0 else []) + [rng.randrange(5, 4000) for _ in range(rng.randint(3, 400))]
        after = i - 1 if i % 10 == 9 else None
        requests.append(
            BenchRequest(
                i,
                rng.choice([1, 2, 5, 30, 90, 300]),
                prompt_token_ids=prompt,
                arrival_s=None if after is not None else t,
                after=after,
            )
        )
        t += rng.expovariate(10.0)
    return Workload(WorkloadSpec("jsonl:planted.jsonl", None), requests)


def replays() -> Replays:
    config = EngineConfig.from_kwargs("unused", max_num_seqs=16, max_num_batched_tokens=256)
    cost = curve(per_token_ms=0.3)
    cost.per_decode_key, cost.per_prompt_pair, cost.per_mixed_key = 2e-6, 1e-8, 3e-6
    return Replays(config, 900 * 16 * 1024, 1024.0, 2048, cost, planted(), None)


def summary_figures(summary: dict[str, Any], sim: Any) -> dict[str, Any]:
    figures = {k: summary[k] for k in ("completed", "failed", "duration_s", "output_throughput", "cached_share")}
    figures |= {k: summary[k] for k in ("kv_live_share", "preemptions")}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        figures |= {f"{metric}.{s}": summary[metric][s] for s in STATS} if summary[metric] else {}
    r = sim.record
    figures |= {"steps": r.steps, "busy_seconds": r.busy_seconds, "peak_blocks": r.peak_blocks}
    figures |= {"live_tokens": r.live_tokens, "allocated_slots": r.allocated_slots}
    figures |= {"decode_only_steps": r.decode_only_steps, "batch_sizes": sum(r.batch_sizes)}
    return figures


def figures() -> dict[str, Any]:
    """Every figure the test holds the code to."""
    r = replays()
    out: dict[str, Any] = {}
    for name, settings, kwargs in SETTINGS:
        if kwargs.get("cost") == "decode-only":
            kwargs = {"cost": DecodeOnlyCost(r.cost)}
        summary, sim = r.run(settings, **kwargs)
        out[name] = summary_figures(summary, sim)
    trace = [TraceRequest(q.prompt_token_ids or [], None, q.max_tokens) for q in r.workload.requests]
    out["lru hits"] = [list(replay_kv_cache(trace, 16, n)) for n in (30, 80, 200, 1000)]
    report = analyse(trace, 16, 300, max_num_batched_tokens=256)
    out["analyse"] = [report.achievable_hit_tokens, report.lru_hit_tokens, [d.position for d in report.divergences]]
    out["sharing"] = list(_sharing(trace, 16))
    agreement = lookup_agreement([t.token_ids for t in trace] + [[1, 2, 3, 4] * 30 + [7, 1, 2, 3] * 10])
    out["lookup"] = [agreement.positions, agreement.tokens_per_step, agreement.drafts_per_step, agreement.proposing]
    return out


@pytest.fixture(scope="module")
def now() -> dict[str, Any]:
    return figures()


@pytest.mark.parametrize("name", NAMES)
def test_each_figure_is_what_the_code_before_the_speed_ups_gave(now, name):
    before = json.loads(FIGURES.read_text())[name]
    if isinstance(before, dict):
        assert set(now[name]) == set(before)
        for key, value in before.items():
            assert now[name][key] == pytest.approx(value, rel=1e-12, abs=1e-15), f"{name}: {key}"
    else:
        assert now[name] == pytest.approx(before, rel=1e-12) if name == "lookup" else now[name] == before


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIGURES.write_text(json.dumps(figures(), indent=1, sort_keys=True) + "\n")


def traces_for_the_peak():
    """(name, workload, cache blocks, the shortcut expected): none shared, in ample room and in a cache
    that evicts; shared system prompts in a cache that keeps them; the same one at a time in a cache
    that evicts them (hits lost, blocks cached again); a cache small enough to preempt."""
    rng = random.Random(7)
    distinct = [[rng.randrange(5, 4000) for _ in range(rng.randint(20, 300))] for _ in range(80)]
    outputs = [rng.choice([1, 8, 40, 120]) for _ in distinct]
    shared = planted()
    requests = [
        BenchRequest(i, o, prompt_token_ids=p, arrival_s=0.02 * i)
        for i, (p, o) in enumerate(zip(distinct, outputs, strict=True))
    ]
    yield "nothing shared", Workload(shared.spec, requests), 900, True
    apart = [dataclasses.replace(q, arrival_s=1000.0 * q.index) for q in requests]
    yield "nothing shared, evicted", Workload(shared.spec, apart), 60, True  # (evictions no hit would have read)
    yield "shared prefixes kept", shared, 900, True
    alone = [dataclasses.replace(q, arrival_s=1000.0 * q.index, after=None) for q in shared.requests]
    yield "shared prefixes evicted", Workload(shared.spec, alone), 60, False  # (one at a time: none refused)
    yield "preemptions", shared, 120, False


@pytest.mark.parametrize(
    ("name", "w", "blocks", "shortcut"), list(traces_for_the_peak()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_the_current_replay_stands_for_an_ample_cache_only_where_it_would_replay_alike(name, w, blocks, shortcut):
    """Where the current replay's KV manager saw nothing an ample cache would do otherwise, the ample
    replay is the same run (every request's times and tokens, the peak); the peak the diagnosis reads
    is the ample replay's either way."""
    from tokenmill.doctor.diagnose import _peak_tokens
    from tokenmill.doctor.simulator import WatchedKV

    r = replays()
    r.workload, r.kv_memory = w, blocks * 16 * 1024  # (a cache of `blocks` blocks at the current settings)
    totals = [len(q.prompt_token_ids or []) + q.max_tokens for q in w.requests]
    ample = sum(-(-t // 16) for t in totals) + 1
    summary, sim = r.run({})
    kv = sim.scheduler.kv
    assert isinstance(kv, WatchedKV) and sim.scheduler.kv.num_blocks == blocks
    whole, ample_sim = r.run({}, num_blocks=ample)
    assert _peak_tokens(r, totals, 16) == ample_sim.record.peak_blocks * 16
    assert kv.same_with(ample) == shortcut
    if shortcut:  # (the same run: fast-forward's stretches may part differently, so sums to rounding)
        now, then = summary_figures(summary, sim), summary_figures(whole, ample_sim)
        assert now.keys() == then.keys() and sim.record.peak_blocks == ample_sim.record.peak_blocks
        for key, value in then.items():
            assert now[key] == (value if value is None else pytest.approx(value, rel=1e-12)), key
