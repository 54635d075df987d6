"""`tokenmill doctor --verify`: each recommendation run against the current settings, side by side, and
withdrawn when it moves neither TTFT nor tokens/s beyond the runs' own noise.

For each finding that recommends settings (and for all of them together, when more than one does), an
engine is built with the current settings changed by them; the current engine and each of these run a
window of the trace (`window`: its first n requests, n the most whose runs all fit `budget_s` by the
simulator's replay of them, `window_size`; a contiguous window keeps the arrival process and load, and
the prompts that share a prefix with their neighbours still do; sparser samples were tried and lose
both: every 23rd request of a shared-prefix trace shared nothing, and kept arrival times cut the load
23-fold) `repeats` times,
interleaved (current, each variant, then again), after a warm-up run of each on the sample's first
quarter (an engine's first run is 2-3x slower on the tiny model: kernels built for new shapes). Per
repeat, a variant's gain over the current run of the same repeat: output tokens/s (variant / current)
and TTFT p50 (current / variant), above 1 better. The noise is the current settings' own run-to-run
spread (max / min - 1 over the repeats, at least NOISE_FLOOR); a recommendation is kept when, for
either metric, its median gain exceeds 1 + noise and its gain in every repeat exceeds 1 + NOISE_FLOOR
(the whole spread above the noise), else withdrawn, and says so. Beside each, the simulator's
prediction for the same sample and settings, and its error against the measured medians: beyond 15%,
the report says that the cost model needs a new probe. Settings that change memory only
(`kv_cache_memory`) are not timed (a memory fit is not a speed claim) and stay as recommended.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import Workload
from tokenmill.doctor.findings import Finding, p50

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

NOISE_FLOOR = 0.05  # a shared machine's run-to-run drift, at least
SIM_TOLERANCE = 0.15
METRICS = ("output_throughput", "ttft_p50_ms")
UNTIMED = ("kv_cache_memory",)


@dataclass
class Verified:
    label: str  # the finding's question, or "all recommended"
    settings: dict[str, Any]
    gains: dict[str, list[float]] = field(default_factory=dict)  # metric -> per repeat (above 1: better)
    measured: dict[str, float] = field(default_factory=dict)  # metric -> median over repeats
    predicted: dict[str, float] = field(default_factory=dict)  # metric -> the simulator's, same sample
    predicted_gain: dict[str, float] = field(default_factory=dict)  # metric -> the simulator's gain
    noise: float = NOISE_FLOOR
    kept: bool = False

    def gain(self, metric: str) -> float:
        return statistics.median(self.gains[metric])

    def sim_error(self, metric: str) -> float:
        return self.predicted[metric] / self.measured[metric] - 1 if self.measured.get(metric) else 0.0

    def line(self) -> str:
        parts = []
        for m in METRICS:
            g = self.gains[m]
            parts.append(
                f"{m.replace('_', ' ')} {self.gain(m):.2f}x [{min(g):.2f}-{max(g):.2f}] measured, "
                f"{self.predicted_gain[m]:.2f}x predicted"
            )
        verdict = "kept" if self.kept else f"withdrawn: neither moves beyond the runs' noise ({self.noise:.0%})"
        return f"{self.label} ({'; '.join(parts)}): {verdict}"


def headline(summary: dict[str, Any]) -> dict[str, float]:
    """The figures a verification compares, from a run summary (`bench.metrics.summarize`)."""
    return {"output_throughput": summary["output_throughput"], "ttft_p50_ms": p50(summary, "ttft")}


def figures(records: Sequence[Any], duration_s: float) -> dict[str, float]:
    return headline(summarize(records, max(duration_s, 1e-9)))


def gain(metric: str, variant: dict[str, float], base: dict[str, float]) -> float:
    """How much better `variant` is than `base` on `metric` (above 1: better; TTFT: lower is better)."""
    if metric == "ttft_p50_ms":
        return base[metric] / max(variant[metric], 1e-9)
    return variant[metric] / max(base[metric], 1e-9)


def window(workload: Workload, count: int) -> Workload:
    """The trace's first `count` requests, in order, with their own arrival times."""
    return Workload(workload.spec, workload.requests[: max(1, count)])


def window_size(duration: Callable[[int], float], total: int, runs: int, budget_s: float, least: int = 8) -> int:
    """The most requests from the trace's start whose run, `runs` times, fits `budget_s` by `duration(n)`
    (the simulator's seconds for the first n); at least `least` (or all, when fewer)."""
    low, high = min(least, total), total
    if runs * duration(high) <= budget_s:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if runs * duration(mid) <= budget_s:
            low = mid
        else:
            high = mid
    return low


def verify(
    current: LLMEngine,
    build: Callable[[dict[str, Any]], LLMEngine],
    workload: Workload,
    findings: list[Finding],
    predict: Callable[[dict[str, Any], Workload], dict[str, float]],
    request_rate: float | None,
    repeats: int = 3,
) -> list[Verified]:
    """Each recommending finding's settings (and all of them, when several) run against `current` on
    `workload` (already sampled) `repeats` times, interleaved; `build(settings)`: an engine with the
    current settings changed by them; `predict(settings, workload)`: the simulator's figures."""
    if repeats < 2:
        raise ValueError(f"repeats: a spread needs at least 2 runs a setting, got {repeats}")
    candidates = [(f.question, {k: v for k, v in f.settings.items() if k not in UNTIMED}) for f in findings]
    candidates = [(label, s) for label, s in candidates if s]
    if len(candidates) > 1:
        merged: dict[str, Any] = {}
        for _, s in candidates:
            merged.update(s)
        candidates.append(("all recommended", merged))
    if not candidates:
        return []
    engines = [(label, s, build(s)) for label, s in candidates]
    warm = Workload(workload.spec, workload.requests[: max(4, len(workload.requests) // 4)])
    for engine in [current, *(e for _, _, e in engines)]:  # (an engine's first run is slow: kernels built)
        run_offline(engine, warm, "warm-up", request_rate=request_rate)
    base: list[dict[str, float]] = []
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in candidates}
    for repeat in range(repeats):
        run = run_offline(current, workload, "current", repeat, request_rate=request_rate)
        base.append(figures(run.records, run.duration_s))
        for label, _, engine in engines:
            run = run_offline(engine, workload, label, repeat, request_rate=request_rate)
            runs[label].append(figures(run.records, run.duration_s))
    noise = max(NOISE_FLOOR, *(max(b[m] for b in base) / max(min(b[m] for b in base), 1e-9) - 1 for m in METRICS))
    before = predict({}, workload)
    out = []
    for label, settings, _ in engines:
        v = Verified(label, settings, noise=noise)
        v.gains = {m: [gain(m, r, b) for r, b in zip(runs[label], base, strict=True)] for m in METRICS}
        v.measured = {m: statistics.median(r[m] for r in runs[label]) for m in METRICS}
        v.predicted = predict(settings, workload)
        v.predicted_gain = {m: gain(m, v.predicted, before) for m in METRICS}
        v.kept = any(min(v.gains[m]) > 1 + NOISE_FLOOR and v.gain(m) > 1 + noise for m in METRICS)
        out.append(v)
    return out


def apply_verdicts(findings: list[Finding], verified: list[Verified]) -> None:
    """Withdraw from each finding the settings its verification did not keep (a note says so), and add
    the measured line to its evidence; a simulator error past SIM_TOLERANCE becomes a pitfall."""
    by_label = {v.label: v for v in verified}
    for f in findings:
        v = by_label.get(f.question)
        if v is None:
            continue
        f.evidence.append("verified: " + v.line())
        for m in METRICS:
            if abs(v.sim_error(m)) > SIM_TOLERANCE:
                f.pitfalls.append(
                    f"the simulator's {m.replace('_', ' ')} for these settings was off by {v.sim_error(m):+.0%} "
                    "against the measured runs: the cost model needs a new probe"
                )
        if not v.kept:
            f.settings = {k: val for k, val in f.settings.items() if k in UNTIMED}
            f.verdict += " — withdrawn by --verify (no gain beyond the runs' noise)"
