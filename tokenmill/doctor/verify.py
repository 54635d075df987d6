"""`tokenmill doctor --verify`: each recommendation run against the current settings, side by side, and
withdrawn when it moves none of TTFT, TPOT and tokens/s beyond the runs' own noise.

For each finding that recommends settings (and for all of them together, when more than one does), an
engine is built with the current settings changed by them; the current engine and each of these run a
window of the trace (`window`: its first n requests, n the most whose runs all fit `budget_s` by the
simulator's replay of them, `window_size`; a contiguous window keeps the arrival process and load, and
the prompts that share a prefix with their neighbours still do; sparser samples were tried and lose
both: every 23rd request of a shared-prefix trace shared nothing, and kept arrival times cut the load
23-fold) `repeats` times, interleaved (current, each variant, then again), after a warm-up run of each
on the sample's first quarter (an engine's first run is much slower than its next: kernels built
for new shapes). Every run starts with the prefix cache empty: the same prompts run again would
otherwise hit blocks the previous run left (a TTFT "gain" that a user's first requests never see).

Per repeat, a variant's gain over the current run of the same repeat: output tokens/s (variant /
current), TTFT p50 and TPOT p50 (current / variant: speculation is for the time between tokens, which at
a trace's load paced by its arrivals moves neither of the others), above 1 better. A metric's noise is
the current settings' own run-to-run spread of it (max / min - 1 over the repeats, at least
NOISE_FLOOR); a recommendation is kept when, for any metric, its median gain exceeds 1 + that noise and
its gain in every repeat exceeds 1 + NOISE_FLOOR, else withdrawn, and says so.

Where a variant caches prefixes, the hit rate its runs measured is reported beside its gains (the
trace's real hit rate, not the replay's). Settings can pay only together (prefix caching under static
batching hits nothing: a batch's prompts are admitted at once). When all of them together are kept, each
one not kept alone is measured by leaving it out: all but it against all, interleaved the same way, the
noise the whole combination's own spread; it stays when the combination loses beyond that noise without
it (`needed`). With nothing to recommend, the current settings run `repeats` times against the
simulator's prediction for them: "nothing to change" rests on what-ifs priced by that cost model,
confirmed when it is within SIM_TOLERANCE. Beside each, the simulator's prediction for the same sample
and settings, and its error against the measured medians: beyond SIM_TOLERANCE, the report says that the
cost model needs a new probe. Settings that change memory only (`kv_cache_memory`) are not timed (a
memory fit is not a speed claim) and stay as recommended.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
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
METRICS = ("output_throughput", "ttft_p50_ms", "tpot_p50_ms")
LOWER_BETTER = ("ttft_p50_ms", "tpot_p50_ms")
UNTIMED = ("kv_cache_memory",)
ALL = "all recommended"
HIT_RATE = "prefix_hit_rate"  # a run's prefix-cache hits over the prompt tokens looked up (not a gain)
CURRENT = "current settings"


@dataclass
class Verified:
    label: str  # the finding's question, ALL, or CURRENT (nothing recommended)
    settings: dict[str, Any]
    gains: dict[str, list[float]] = field(default_factory=dict)  # metric -> per repeat (above 1: better)
    measured: dict[str, float] = field(default_factory=dict)  # metric -> median over repeats
    predicted: dict[str, float] = field(default_factory=dict)  # metric -> the simulator's, same sample
    predicted_gain: dict[str, float] = field(default_factory=dict)  # metric -> the simulator's gain
    noise: dict[str, float] = field(default_factory=dict)  # metric -> the baseline's own spread
    needed: dict[str, list[float]] = field(default_factory=dict)  # metric -> per repeat: all / all but this
    needed_noise: dict[str, float] = field(default_factory=dict)  # metric -> the combination's own spread
    hit_rate: float = 0.0  # the prefix cache's hit rate in these settings' runs (median), as measured
    kept: bool = False

    def gain(self, metric: str) -> float:
        return statistics.median(self.gains[metric])

    def sim_error(self, metric: str) -> float:
        return self.predicted[metric] / self.measured[metric] - 1 if self.measured.get(metric) else 0.0

    def line(self) -> str:
        if self.label == CURRENT:
            errors = ", ".join(f"{m.replace('_', ' ')} {self.sim_error(m):+.0%}" for m in METRICS)
            verdict = "confirmed" if self.kept else "not confirmed: the cost model needs a new probe"
            return (
                f"{CURRENT} run {len(self.gains[METRICS[0]])} times: output "
                f"{self.measured['output_throughput']:.1f} tokens/s, TTFT p50 {self.measured['ttft_p50_ms']:.0f} ms "
                f"(spread {self._spread()}); the simulator's error on them {errors}: nothing to change {verdict}"
            )
        parts = [
            f"{m.replace('_', ' ')} {self.gain(m):.2f}x [{min(g):.2f}-{max(g):.2f}] measured, "
            f"{self.predicted_gain[m]:.2f}x predicted"
            for m, g in self.gains.items()
        ]
        if self.hit_rate > 0:
            parts.append(f"prefix-cache hits measured: {self.hit_rate:.0%} of prompt tokens")
        if self.needed:
            together = "; ".join(
                f"{m.replace('_', ' ')} {statistics.median(g):.2f}x [{min(g):.2f}-{max(g):.2f}]"
                for m, g in self.needed.items()
            )
            parts.append(f"all recommended against all but this: {together} (noise {self._spread(needed=True)})")
        if self.kept:
            verdict = "kept" if not self.needed else "kept: the others lose without it"
        elif self.needed:
            verdict = "withdrawn: alone or left out of the rest, it moves none beyond the runs' noise"
        else:
            verdict = f"withdrawn: none moves beyond the runs' noise ({self._spread()})"
        return f"{self.label} ({'; '.join(parts)}): {verdict}"

    def _spread(self, needed: bool = False) -> str:
        noise = self.needed_noise if needed else self.noise
        return ", ".join(f"{m.replace('_', ' ')} {v:.0%}" for m, v in noise.items())


def headline(summary: dict[str, Any]) -> dict[str, float]:
    """The figures a verification compares, from a run summary (`bench.metrics.summarize`)."""
    return {
        "output_throughput": summary["output_throughput"],
        "ttft_p50_ms": p50(summary, "ttft"),
        "tpot_p50_ms": p50(summary, "tpot"),
    }


def figures(records: Sequence[Any], duration_s: float) -> dict[str, float]:
    return headline(summarize(records, max(duration_s, 1e-9)))


def gain(metric: str, variant: dict[str, float], base: dict[str, float]) -> float:
    """How much better `variant` is than `base` on `metric` (above 1: better; latencies: lower is better;
    1 where a run gave none, as TPOT without a second token)."""
    if metric in LOWER_BETTER:
        return base[metric] / variant[metric] if base[metric] > 0 and variant[metric] > 0 else 1.0
    return variant[metric] / max(base[metric], 1e-9)


def spread(runs: list[dict[str, float]]) -> dict[str, float]:
    """metric -> max / min - 1 over `runs`, at least NOISE_FLOOR."""
    return {m: max(NOISE_FLOOR, max(r[m] for r in runs) / max(min(r[m] for r in runs), 1e-9) - 1) for m in METRICS}


def beyond_noise(gains: dict[str, list[float]], noise: dict[str, float]) -> bool:
    """For any metric: the median gain above 1 + its noise, and every repeat's above 1 + NOISE_FLOOR."""
    return any(min(g) > 1 + NOISE_FLOOR and statistics.median(g) > 1 + noise[m] for m, g in gains.items())


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


def runs_needed(recommending: int, repeats: int) -> int:
    """Runs of the window --verify makes for `recommending` findings (the warm-ups, a quarter each, as
    one); leave-one-out runs, when a combination needs them, come on top."""
    variants = recommending + (recommending > 1) if recommending else 0
    return repeats * (1 + variants) + 1


Runner = Callable[[Any, Workload, str, int], dict[str, float]]  # (engine, workload, label, repeat) -> headline


def offline_runner(request_rate: float | None) -> Runner:
    """A run of a window on an in-process engine (`bench.offline`), its prefix cache emptied first."""

    def run(engine: LLMEngine, workload: Workload, label: str, repeat: int) -> dict[str, float]:
        engine.reset_prefix_cache()
        before = engine.stats()
        done = run_offline(engine, workload, label, repeat, request_rate=request_rate)
        after = engine.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0
        return {**figures(done.records, done.duration_s), HIT_RATE: hits}

    return run


def rounds(
    engines: list[tuple[str, Any]], workload: Workload, run: Runner, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """label -> each repeat's figures: a warm-up of each engine on the first quarter, then `repeats`
    rounds of one run each, in order."""
    warm = Workload(workload.spec, workload.requests[: max(4, len(workload.requests) // 4)])
    for label, engine in engines:  # (an engine's first run is slow: kernels built)
        run(engine, warm, f"warm-up {label}", 0)
    out: dict[str, list[dict[str, float]]] = {label: [] for label, _ in engines}
    for repeat in range(repeats):
        for label, engine in engines:
            out[label].append(run(engine, workload, label, repeat))
    return out


def verify(
    current: Any,  # an LLMEngine, or whatever `run` runs
    build: Callable[[dict[str, Any]], Any],
    workload: Workload,
    findings: list[Finding],
    predict: Callable[[dict[str, Any], Workload], dict[str, float]],
    run: Runner,
    repeats: int = 3,
) -> list[Verified]:
    """Each recommending finding's settings (and all of them, when several) run against `current` on
    `workload` (already sampled) `repeats` times, interleaved; `build(settings)`: an engine with the
    current settings changed by them; `predict(settings, workload)`: the simulator's figures; `run`: one
    measured run (`offline_runner`). With nothing recommended, the current settings' runs against their
    prediction (label CURRENT)."""
    if repeats < 2:
        raise ValueError(f"repeats: a spread needs at least 2 runs a setting, got {repeats}")
    candidates = [(f.question, {k: v for k, v in f.settings.items() if k not in UNTIMED}) for f in findings]
    candidates = [(label, s) for label, s in candidates if s]
    before = predict({}, workload)
    if not candidates:
        return [_confirm(rounds([(CURRENT, current)], workload, run, repeats)[CURRENT], before)]
    if len(candidates) > 1:
        candidates.append((ALL, merged(s for _, s in candidates)))
    engines = {label: build(s) for label, s in candidates}
    measured = rounds([(CURRENT, current), *engines.items()], workload, run, repeats)
    base = measured[CURRENT]
    out = []
    for label, settings in candidates:
        v = Verified(label, settings, noise=spread(base))
        v.gains = {m: [gain(m, r, b) for r, b in zip(measured[label], base, strict=True)] for m in METRICS}
        v.measured = {m: statistics.median(r[m] for r in measured[label]) for m in METRICS}
        v.hit_rate = statistics.median(r.get(HIT_RATE, 0.0) for r in measured[label])
        v.predicted = predict(settings, workload)
        v.predicted_gain = {m: gain(m, v.predicted, before) for m in METRICS}
        v.kept = beyond_noise(v.gains, v.noise)
        out.append(v)
    if out[-1].label == ALL and out[-1].kept:
        combination = engines.pop(ALL)
        engines.clear()  # (their KV caches freed before more engines are built)
        _leave_out([v for v in out[:-1] if not v.kept], candidates[:-1], combination, build, workload, run, repeats)
    return out


def merged(settings: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Several findings' settings as one configuration (a later one's value for a field wins)."""
    out: dict[str, Any] = {}
    for s in settings:
        out.update(s)
    return out


def _leave_out(
    members: list[Verified],
    candidates: list[tuple[str, dict[str, Any]]],
    combination: Any,
    build: Callable[[dict[str, Any]], Any],
    workload: Workload,
    run: Runner,
    repeats: int,
) -> None:
    """Each member not kept alone, measured as what the combination loses without it."""
    if not members:
        return
    without = {v.label: build(merged(s for label, s in candidates if label != v.label)) for v in members}
    measured = rounds([(ALL, combination), *without.items()], workload, run, repeats)
    noise = spread(measured[ALL])
    for v in members:
        v.needed = {m: [gain(m, a, w) for a, w in zip(measured[ALL], measured[v.label], strict=True)] for m in METRICS}
        v.needed_noise = noise
        v.kept = beyond_noise(v.needed, noise)


def _confirm(runs: list[dict[str, float]], predicted: dict[str, float]) -> Verified:
    v = Verified(CURRENT, {}, noise=spread(runs), predicted=predicted)
    v.measured = {m: statistics.median(r[m] for r in runs) for m in METRICS}
    v.gains = {m: [1.0] * len(runs) for m in METRICS}  # (against itself)
    v.predicted_gain = {m: 1.0 for m in METRICS}
    v.kept = all(abs(v.sim_error(m)) <= SIM_TOLERANCE for m in METRICS)
    return v


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
