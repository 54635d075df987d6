"""A capacity search's replays stop once their SLOs are missed whatever the rest of the trace does
(slo_watch.py): the count that settles a percentile against numpy's, `run_offline`'s `until`, and the
searches (question 6's at p90, a target's at p99) giving the same rates with the watch as without,
with fewer requests replayed."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tests.doctor.test_replay_figures import replays
from tokenmill.bench.offline import run_offline
from tokenmill.bench.records import RequestRecord
from tokenmill.doctor.scale import capacity
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.slo_watch import SloWatch, needed
from tokenmill.doctor.targets import capacity_p99


@pytest.mark.parametrize("percentile", [50, 90, 99])
def test_a_percentile_is_past_a_limit_once_the_needed_count_of_values_is(percentile):
    """The worst case for the count: the values past the limit only just past it, all the others 0."""
    rng = random.Random(percentile)
    for n in [*range(1, 60), *rng.sample(range(60, 20_000), 40)]:
        k = needed(n, percentile)
        assert 1 <= k <= n
        seconds = [0.0] * (n - k) + [0.05 * (1 + 2e-9)] * k  # (as bench.metrics.distribution takes them)
        assert np.percentile(np.asarray(seconds) * 1e3, percentile) > 50.0, (n, k)
        exact = n - math.floor(percentile * (n - 1) / 100)
        assert k <= exact + 1  # (one more than the exact count at most: the watch stops as soon as it can)


def record(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(0, ok, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)


def test_the_watch_counts_each_slo_past_its_limit_and_stops_at_a_failure():
    watch = SloWatch.of({"ttft": 100.0, "tpot": 10.0, "e2e": 1.0}, 90)  # (e2e: not what a search judges)
    assert watch.describe() == "TPOT p90 10 ms and TTFT p90 100 ms"
    missed = watch.watch(20)  # (3 values past a limit settle p90 of 20: rank floor(0.9 x 19) = 17)
    assert needed(20, 90) == 4
    assert not missed(record(0.5, 0.6, 11))  # TTFT past (500 ms), TPOT 10 ms: not past
    assert not missed(record(0.5, 0.6, 11)) and not missed(record(0.5, 0.6, 11))
    assert not missed(record(0.01, 1.0, 2))  # TPOT past
    assert missed(record(0.5, 0.6, 1))  # the fourth TTFT past (a one-token reply: no TPOT)
    assert SloWatch.of({"ttft": 100.0}, 99).watch(10)(record(0.0, 0.0, 1, ok=False))  # a failure settles it


def test_run_offline_stops_when_until_says_so():
    r = replays()
    sim = SimulatedEngine(r.config, 900, r.max_model_len, r.cost)
    finished: list[RequestRecord] = []
    run = run_offline(
        sim,
        r.workload,
        "t",
        clock=sim.clock,
        sleep=sim.sleep,
        until=lambda x: finished.append(x) or len(finished) == 20,
    )
    assert run.extras["stopped"] and len(finished) == 20
    assert sum(x.ok for x in run.records) >= 20 and len(run.records) < len(r.workload.requests)
    unfinished = [x for x in run.records if not x.ok]
    assert unfinished and all(x.error == "not finished: the run was stopped early" for x in unfinished)


@pytest.mark.parametrize(("search", "percentile"), [(capacity, 90), (capacity_p99, 99)])
@pytest.mark.parametrize("slos", [{"tpot": 40.0}, {"ttft": 3000.0}, {"ttft": 8000.0, "tpot": 60.0}, {"tpot": 1.0}])
def test_a_watched_search_finds_the_same_rate_replaying_fewer_requests(search, percentile, slos):
    whole, watched = replays(), replays()
    asked: list[float] = []

    def plain(rate: float):
        asked.append(rate)
        return whole.run({}, request_rate=rate)[0]

    watch = SloWatch.of(slos, percentile)
    stopped: list[int] = []

    def stopping(rate: float):
        summary = watched.run({}, request_rate=rate, watch=watch)[0]
        if summary.get("stopped"):
            stopped.append(summary["completed"])
        return summary

    assert search(stopping, slos, 5.0) == search(plain, slos, 5.0)
    assert len(watched._done) == len(whole._done) == len(set(asked))
    if slos == {"tpot": 1.0}:  # (no rate meets it: every replay stops early)
        assert len(stopped) == len(asked)
    assert stopped  # (each case has rates past its SLOs)
    assert all(n < len(whole.workload.requests) for n in stopped)


def test_a_whole_replay_of_the_same_setting_is_run_after_a_stopped_one_and_kept():
    r = replays()
    watch = SloWatch.of({"tpot": 1.0}, 90)
    stopped = r.run({}, request_rate=5.0, watch=watch)[0]
    assert stopped["stopped"] and stopped["failed"] == 150 - stopped["completed"]
    whole = r.run({}, request_rate=5.0)[0]
    assert "stopped" not in whole and whole["completed"] == 150
    assert r.run({}, request_rate=5.0, watch=watch)[0] is whole  # (a whole replay answers a watched one)
