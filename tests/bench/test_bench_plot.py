"""bench plot: PNG charts from result files, and the result file round trip they read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.metrics import summarize
from tokenmill.bench.plot import (
    LATENCY_CDF,
    THROUGHPUT_LATENCY,
    by_label,
    curve,
    latency_samples,
    plot_results,
    use_log_scale,
)
from tokenmill.bench.records import BenchResult, RequestRecord, Run, read_result

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(index: int, ttft_s: float, itl_s: list[float], ok: bool = True) -> RequestRecord:
    if not ok:
        return RequestRecord(index=index, ok=False, error="HTTP 500: boom", start_s=0.01 * index)
    return RequestRecord(
        index=index,
        ok=True,
        start_s=0.01 * index,
        prompt_tokens=16,
        output_tokens=len(itl_s) + 1,
        ttft_s=ttft_s,
        e2e_s=ttft_s + sum(itl_s),
        itl_s=list(itl_s),
    )


def _run(label: str, repeat: int, settings: dict[str, object], scale: float, duration_s: float = 2.0) -> Run:
    records = [
        _record(0, 0.020 * scale, [0.010 * scale, 0.012 * scale]),
        _record(1, 0.030 * scale, [0.011 * scale, 0.013 * scale, 0.015 * scale]),
        _record(2, 0.050 * scale, [0.009 * scale]),
        _record(3, 0.0, [], ok=False),
    ]
    return Run(
        label=label,
        repeat=repeat,
        settings=settings,
        duration_s=duration_s,
        records=records,
        summary=summarize(records, duration_s),
    )


def _result(runs: list[Run], tool: str = "serve") -> BenchResult:
    return BenchResult(
        tool=tool,
        command=["tokenmill", "bench", tool],
        workload={"kind": "random", "requests": 4},
        config={"model": "tiny"},
        runs=runs,
    )


def _sweep() -> BenchResult:
    return _result(
        [
            _run("max-concurrency=1", 0, {"max-concurrency": 1}, 1.0),
            _run("max-concurrency=1", 1, {"max-concurrency": 1}, 1.2),
            _run("max-concurrency=8", 0, {"max-concurrency": 8}, 3.0, duration_s=1.0),
        ]
    )


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert len(data) > 0
    assert data.startswith(PNG_SIGNATURE)


def test_round_trip_keeps_records(tmp_path: Path) -> None:
    result = _sweep()
    path = tmp_path / "results" / "sweep.json"
    result.write(path)
    back = read_result(path)
    # record times are written to the microsecond
    for run_back, run in zip(back.runs, result.runs, strict=True):
        for a, b in zip(run_back.records, run.records, strict=True):
            for key in ("start_s", "ttft_s", "e2e_s"):
                assert getattr(a, key) == pytest.approx(getattr(b, key), abs=1e-6)
            assert a.itl_s == pytest.approx(b.itl_s, abs=1e-6)
            assert (a.index, a.ok, a.error, a.output_tokens) == (b.index, b.ok, b.error, b.output_tokens)
    assert back.aggregate == result.aggregate and back.command == result.command


def test_sweep_writes_both_charts(tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    _sweep().write(path)
    out = tmp_path / "plots" / "nested"
    paths = plot_results([("sweep", read_result(path))], out)
    assert [p.name for p in paths] == [LATENCY_CDF, THROUGHPUT_LATENCY]
    assert all(p.parent == out for p in paths)
    for p in paths:
        _assert_png(p)


def test_single_label_writes_only_the_cdf(tmp_path: Path) -> None:
    repeats = _result([_run("default", 0, {}, 1.0), _run("default", 1, {}, 1.1)])
    paths = plot_results([("repeats", repeats)], tmp_path)
    assert [p.name for p in paths] == [LATENCY_CDF]
    _assert_png(paths[0])
    assert not (tmp_path / THROUGHPUT_LATENCY).exists()


def test_several_results_one_with_variants(tmp_path: Path) -> None:
    variants = _result(
        [
            _run("scheduling=static", 0, {"scheduling": "static"}, 2.0),
            _run("scheduling=continuous", 0, {"scheduling": "continuous"}, 1.0),
        ],
        tool="offline",
    )
    single = _result([_run("default", 0, {}, 1.0)])
    paths = plot_results([("variants", variants), ("single", single)], tmp_path)
    assert sorted(p.name for p in paths) == sorted([LATENCY_CDF, THROUGHPUT_LATENCY])
    for p in paths:
        _assert_png(p)


def test_wide_latencies_and_missing_itl_still_plot(tmp_path: Path) -> None:
    # One-token replies: no ITL and no TPOT anywhere; TTFT spans far more than the log-scale ratio.
    records = [_record(0, 0.001, []), _record(1, 2.0, [])]
    runs = [
        Run(label="a", repeat=0, settings={}, duration_s=3.0, records=records, summary=summarize(records, 3.0)),
        Run(label="b", repeat=0, settings={}, duration_s=3.0, records=records, summary=summarize(records, 3.0)),
    ]
    paths = plot_results([("short", _result(runs))], tmp_path)
    assert [p.name for p in paths] == [LATENCY_CDF, THROUGHPUT_LATENCY]
    for p in paths:
        _assert_png(p)


def test_no_successful_records_raises(tmp_path: Path) -> None:
    failed = [_record(i, 0.0, [], ok=False) for i in range(3)]
    broken = _result([Run(label="x", repeat=0, settings={}, duration_s=1.0, records=failed)])
    with pytest.raises(ValueError, match="broken-run"):
        plot_results([("good", _sweep()), ("broken-run", broken)], tmp_path / "plots")
    assert not (tmp_path / "plots").exists()


def test_no_results_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no results"):
        plot_results([], tmp_path)


def test_latency_samples_pool_successful_repeats() -> None:
    groups = by_label(_sweep().runs)
    assert list(groups) == ["max-concurrency=1", "max-concurrency=8"]
    ttft, itl = latency_samples(groups["max-concurrency=1"])
    assert ttft == pytest.approx([20.0, 30.0, 50.0, 24.0, 36.0, 60.0])
    assert itl == pytest.approx([10.0, 12.0, 11.0, 13.0, 15.0, 9.0, 12.0, 14.4, 13.2, 15.6, 18.0, 10.8])


def test_curve_takes_medians_in_label_order() -> None:
    result = _sweep()
    points = curve(by_label(result.runs), "ttft")
    assert [label for label, _, _ in points] == ["max-concurrency=1", "max-concurrency=8"]
    first = result.runs[:2]
    _, x, y = points[0]
    assert x == pytest.approx(sum(r.summary["output_throughput"] for r in first) / 2)
    assert y == pytest.approx(sum(r.summary["ttft"]["median"] for r in first) / 2)
    assert points[1][2] == pytest.approx(result.runs[2].summary["ttft"]["median"])


def test_curve_skips_labels_without_the_latency() -> None:
    one_token = [_record(0, 0.01, [])]
    runs = [
        Run(label="short", repeat=0, settings={}, duration_s=1.0, records=one_token, summary=summarize(one_token, 1.0)),
        _run("long", 0, {}, 1.0),
    ]
    assert [label for label, _, _ in curve(by_label(runs), "tpot")] == ["long"]
    assert [label for label, _, _ in curve(by_label(runs), "ttft")] == ["short", "long"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], False), ([0.0, 0.0], False), ([1.0, 50.0], False), ([0.0, 1.0, 51.0], True), ([-5.0, 2.0, 200.0], True)],
)
def test_log_scale_rule(values: list[float], expected: bool) -> None:
    assert use_log_scale(values) is expected


def test_read_result_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such result file"):
        read_result(tmp_path / "absent.json")


def test_read_result_not_json(tmp_path: Path) -> None:
    path = tmp_path / "garbage.json"
    path.write_text("this is { not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_result(path)


@pytest.mark.parametrize("text", ["[1, 2, 3]", '{"tool": "serve"}', '{"version": 99, "runs": []}', '{"version": 1}'])
def test_read_result_not_a_result(tmp_path: Path, text: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="not a tokenmill bench result"):
        read_result(path)
