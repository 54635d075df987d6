"""Charts of bench results: latency CDFs and throughput-vs-latency curves, written as PNG files.

Owns turning `BenchResult`s (see `records`) into images and nothing else: it pools request records
and takes medians of the per-run summaries that `metrics.summarize` already wrote, but defines no
metric of its own. It draws with matplotlib's object API (`Figure` + `FigureCanvasAgg`), so it needs
no display and touches no pyplot global state.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tokenmill.bench.records import BenchResult, Run

LATENCY_CDF = "latency_cdf.png"
THROUGHPUT_LATENCY = "throughput_latency.png"
LOG_RATIO = 50.0  # a latency axis goes log scale when max / min of its positive values exceeds this
PANEL_INCHES = (6.0, 4.5)  # width, height of one panel
DPI = 120

# One latency panel of the throughput chart: summary key, axis label.
CURVE_PANELS = (("tpot", "TPOT p50 (ms)"), ("ttft", "TTFT p50 (ms)"))

Point = tuple[str, float, float]  # run label, output throughput (tokens/s), latency (ms)


def plot_results(results: list[tuple[str, BenchResult]], out_dir: Path) -> list[Path]:
    """Write the charts for `results` ((short name, result) pairs) into `out_dir`; return their paths.

    Always `latency_cdf.png`; `throughput_latency.png` too when some result has two or more run labels
    (a sweep or several variants). A ValueError names a result with no successful request."""
    if not results:
        raise ValueError("plot: no results to plot")
    for name, result in results:
        if not any(rec.ok for run in result.runs for rec in run.records):
            raise ValueError(f"{name}: no successful requests in any run, nothing to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grouped = [(name, by_label(result.runs)) for name, result in results]
    paths = [_latency_cdf(grouped, out_dir / LATENCY_CDF)]
    if any(len(labels) >= 2 for _, labels in grouped):
        paths.append(_throughput_latency(grouped, out_dir / THROUGHPUT_LATENCY))
    return paths


def by_label(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by label (repeats of one configuration), labels in the order they first appear."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    return groups


def latency_samples(runs: Sequence[Run]) -> tuple[list[float], list[float]]:
    """TTFT and ITL samples in ms, pooled over the successful records of `runs`."""
    done = [rec for run in runs for rec in run.records if rec.ok]
    ttft = [rec.ttft_s * 1e3 for rec in done if rec.ttft_s is not None]
    itl = [gap * 1e3 for rec in done for gap in rec.itl_s]
    return ttft, itl


def use_log_scale(values: Sequence[float]) -> bool:
    """Whether the positive values span more than LOG_RATIO (max / min)."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) / min(positive) > LOG_RATIO


def curve(groups: dict[str, list[Run]], latency: str) -> list[Point]:
    """One point per label: median over repeats of output throughput and of `summary[latency]["median"]`.

    Labels without that latency (its distribution is None) or without a throughput are left out."""
    points: list[Point] = []
    for label, runs in groups.items():
        xs = [float(x) for run in runs if isinstance(x := run.summary.get("output_throughput"), int | float)]
        ys = [float(d["median"]) for run in runs if isinstance(d := run.summary.get(latency), dict)]
        if xs and ys:
            points.append((label, statistics.median(xs), statistics.median(ys)))
    return points


def _latency_cdf(grouped: Sequence[tuple[str, dict[str, list[Run]]]], path: Path) -> Path:
    fig, (ax_ttft, ax_itl) = _figure(2)
    ttft_lines: list[tuple[str, list[float]]] = []
    itl_lines: list[tuple[str, list[float]]] = []
    for name, groups in grouped:
        for label, runs in groups.items():
            ttft, itl = latency_samples(runs)
            ttft_lines.append((f"{name}: {label}", ttft))
            itl_lines.append((f"{name}: {label}", itl))
    _cdf_panel(ax_ttft, ttft_lines, "TTFT (ms)", "Time to first token")
    _cdf_panel(ax_itl, itl_lines, "ITL (ms)", "Inter-token latency")
    fig.suptitle("Latency CDFs (successful requests, repeats pooled)")
    return _save(fig, path)


def _cdf_panel(ax: Axes, lines: Sequence[tuple[str, list[float]]], xlabel: str, title: str) -> None:
    drawn = [(name, sorted(values)) for name, values in lines if values]
    for name, values in drawn:
        n = len(values)
        ax.plot(values, [(i + 1) / n for i in range(n)], drawstyle="steps-post", label=f"{name} (n={n})")
    if use_log_scale([v for _, values in drawn for v in values]):
        ax.set_xscale("log")
    _finish(ax, xlabel, "fraction of samples ≤ x", title, bool(drawn))
    ax.set_ylim(0.0, 1.02)


def _throughput_latency(grouped: Sequence[tuple[str, dict[str, list[Run]]]], path: Path) -> Path:
    fig, axes = _figure(len(CURVE_PANELS))
    for ax, (latency, ylabel) in zip(axes, CURVE_PANELS, strict=True):
        drawn = False
        for name, groups in grouped:
            points = curve(groups, latency)
            if points:
                _curve_series(ax, name, points)
                drawn = True
        ax.margins(0.12)  # room for the point labels
        _finish(ax, "output throughput (tokens/s)", ylabel, f"{latency.upper()} vs throughput", drawn)
    fig.suptitle("Throughput vs latency (medians over repeats)")
    return _save(fig, path)


def _curve_series(ax: Axes, name: str, points: Sequence[Point]) -> None:
    xs = [x for _, x, _ in points]
    ys = [y for _, _, y in points]
    ax.plot(xs, ys, marker="o", label=name)
    for label, x, y in points:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)


def _figure(panels: int) -> tuple[Figure, list[Axes]]:
    width, height = PANEL_INCHES
    fig = Figure(figsize=(width * panels, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _finish(ax: Axes, xlabel: str, ylabel: str, title: str, drawn: bool) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path
