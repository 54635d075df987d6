"""The doctor's speed on a long trace (issue 46, item 5): a 10,000-request window of a trace in Azure's
format is read, shaped to a 1,024-token context and replayed through the simulator (`diagnose.Replays`,
as the doctor replays it) in under a minute, every request finished and every KV block given back.
Marked slow (it takes seconds to tens of seconds on a shared machine): `make test-all` runs it."""

from __future__ import annotations

import csv
import random
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.doctor.test_doctor import curve
from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.config import EngineConfig
from tokenmill.doctor.diagnose import Replays
from tokenmill.doctor.traces.load import TraceFlags, load_workload

WINDOW = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "azure_conv_window.csv"


def azure_like(path: Path, requests: int, rate: float, seed: int = 0) -> None:
    """`requests` rows in Azure's format: lengths drawn from Azure's conversation window, Poisson arrivals."""
    with WINDOW.open(newline="") as f:
        rows = [(r["ContextTokens"], r["GeneratedTokens"]) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    t = datetime(2023, 11, 16, 18, 0, 0)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for _ in range(requests):
            out.writerow([t.isoformat(sep=" "), *rng.choice(rows)])
            t += timedelta(seconds=rng.expovariate(rate))


@pytest.mark.slow
def test_a_10000_request_window_reads_and_replays_in_under_a_minute(tmp_path):
    path = tmp_path / "azure_like.csv"
    azure_like(path, 12_000, rate=5.0)
    start = time.perf_counter()
    spec = WorkloadSpec(f"azure:{path}", 10_000)
    workload, info = load_workload(spec, None, 1024, 8192, TraceFlags(None, 1.0, "fit"))
    read_s = time.perf_counter() - start
    config = EngineConfig.from_kwargs("unused", max_num_seqs=64)
    cost = curve(per_token_ms=0.02, base_ms=3.0)  # (a small model's steps: ~5 ms a decode step of 64)
    cost.per_decode_key = 2e-8
    blocks = 4000  # (a cache the load overflows at times: admission waits on blocks too)
    replays = Replays(config, blocks * 16 * 1024, 1024.0, 1024, cost, workload, None)
    start = time.perf_counter()
    summary = replays({})
    replay_s = time.perf_counter() - start
    print(f"10,000 requests: read and shaped in {read_s:.1f} s, replayed in {replay_s:.1f} s")
    assert len(workload.requests) == 10_000 and info is not None
    assert summary["completed"] == 10_000 and not summary["failed"]
    sim = replays.engine({})
    assert sim.scheduler.kv.num_free_blocks == sim.scheduler.kv.num_blocks
    assert read_s + replay_s < 60.0
