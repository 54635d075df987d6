"""`--target`: the doctor's answers for a machine that is not this one, from the roofline step model.

For each target (hardware.py's sheets, or `here`), the model (this one's config, or `--model-config`'s
for one whose weights are not here) is priced step by step by `roofline.RooflineCost` and the trace
replayed on those prices through the same simulator (`replays.Replays`: the real scheduler and KV
manager at the current settings, a KV cache of what the target's memory leaves). The factors:
- `here`: fitted to this machine's probed steps against its own measured roofline: "roofline,
  calibrated", the band being the fit's largest error on those steps;
- a target whose steps a file measured (`--target-steps`): fitted to those: "roofline, calibrated";
- any other: this machine's factors carried over: "roofline, uncalibrated"; the band this machine's
  fit supports is stated, and so is what it does not cover (a GPU's kernels reach other shares of
  its roofline), with the replay at efficiency 1 and no overhead beside it as the best case.
Answers: fits or not (weights + the trace's peak KV in `USABLE` of the memory, less an activation
reserve), TTFT/TPOT p50/p99 of the replay, the replicas the trace's rate needs (one replica's highest
Poisson rate meeting the SLOs at p99, at most its ceiling: the trace all at once; without SLOs 80% of
that ceiling), cost per 1M output tokens at a price.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.workloads import Workload
from tokenmill.config import EngineConfig
from tokenmill.doctor.findings import p50, p99
from tokenmill.doctor.hardware import Target, TargetError, load_target
from tokenmill.doctor.model_fit import activation_reserve, count_parameters
from tokenmill.doctor.roofline import WEIGHT_DTYPES, Calibration, Fit, ModelShape, RooflineCost, fit, probe_points
from tokenmill.doctor.slo_watch import SloWatch
from tokenmill.doctor.step_cost import StepCost
from tokenmill.models.config import ModelConfig, load_config, parse_config

USABLE = 0.9  # share of a target's memory for weights, activations and KV cache (the rest: runtime, fragments)
IDEAL = Calibration(Fit(1.0, 0.0, 0.0, 0), Fit(1.0, 0.0, 0.0, 0), "none: efficiency 1, no overhead", "")


def read_model_config(spec: str) -> ModelConfig:
    """`--model-config`: a config.json file or a model folder holding one (weights not needed)."""
    path = Path(spec)
    if path.is_dir():
        return load_config(path)
    if not path.is_file():
        raise ValueError(f"--model-config: {spec} is neither a config.json file nor a folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model-config: {path}: malformed JSON ({e})") from None
    return parse_config(raw, str(path))


@dataclass
class MeasuredSteps:
    """`--target-steps FILE`: a target's steps measured on it (JSON: target, source, model_config,
    weight_dtype, steps: [{chunks: [[q, s], ...], decoding, seconds}])."""

    target: Target
    calibration: Calibration


def read_measured_steps(path: str, price_per_hour: float | None) -> MeasuredSteps:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        cfg = parse_config(raw["model_config"], f"{path}: model_config")
        weight_dtype = raw.get("weight_dtype", "bfloat16")
        target = load_target(raw["target"], price_per_hour)
        shape = ModelShape.of(cfg, WEIGHT_DTYPES[weight_dtype][0])
        cost = RooflineCost(shape, target, IDEAL, WEIGHT_DTYPES[weight_dtype][1])
        pairs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for s in raw["steps"]:
            chunks = [(int(q), int(p)) for q, p in s["chunks"]]
            pairs[bool(s["decoding"])].append((cost.predict(chunks, bool(s["decoding"])), float(s["seconds"])))
        source = f"{raw.get('source', path)} ({len(raw['steps'])} steps measured on {target.name}, {path})"
        return MeasuredSteps(target, Calibration(fit(pairs[True]), fit(pairs[False]), source, target.name))
    except (OSError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, TargetError):
            raise
        raise ValueError(f"--target-steps: {path}: {type(e).__name__}: {e}") from None


def measured_steps_record(
    cost: StepCost, target: str, model_config: dict[str, Any], weight_dtype: str, source: str
) -> dict[str, Any]:
    """A `--target-steps` file's content from a probe run on the target (benchmarks/gpu/target_steps.py):
    the probe's decode and prompt step shapes with their measured seconds."""
    decode, prompt = probe_points(cost)
    steps = [
        {"chunks": chunks, "decoding": decoding, "seconds": cost.predict(chunks, decoding)}
        for shapes, decoding in ((decode, True), (prompt, False))
        for chunks in shapes
    ]
    return {
        "target": target,
        "source": source,
        "model_config": model_config,
        "weight_dtype": weight_dtype,
        "steps": steps,
    }


@dataclass
class TargetAnswer:
    target: Target
    label: str  # "roofline, calibrated ..." or "roofline, uncalibrated ..."
    band: float | None  # the relative error the calibration supports; None: uncalibrated (no band)
    fit_line: str
    fits: bool
    summary: dict[str, Any] | None = None  # the replay's, on the target's priced steps
    best_case: dict[str, Any] | None = None  # the replay at efficiency 1, no overhead (uncalibrated targets)
    replica_rate: float = 0.0
    replicas: int = 0
    cost_per_million: float | None = None
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        t, s = self.target, self.summary
        out = [f"**{t.name}** ({t.description}; {t.source}): {self.label}", f"fits: {self.fit_line}"]
        if s is not None:
            said = (
                "roofline, uncalibrated: no error band"
                if self.band is None
                else f"within ±{self.band:.0%} on this calibration's own steps"
            )
            out.append(
                f"TTFT p50 / p99 {p50(s, 'ttft'):.1f} / {p99(s, 'ttft'):.1f} ms, TPOT p50 / p99 {p50(s, 'tpot'):.2f} / "
                f"{p99(s, 'tpot'):.2f} ms, output {s['output_throughput']:.1f} tokens/s (predicted, {said})"
            )
            out.append(f"one replica sustains {self.replica_rate:.2f} requests/s; replicas needed: {self.replicas}")
        if self.best_case is not None:
            b = self.best_case
            out.append(
                "best case (efficiency 1, no overhead): "
                f"TTFT p50 / p99 {p50(b, 'ttft'):.3g} / {p99(b, 'ttft'):.3g} ms, "
                f"TPOT p50 / p99 {p50(b, 'tpot'):.3g} / {p99(b, 'tpot'):.3g} ms, "
                f"output {b['output_throughput']:.4g} tokens/s"
            )
        if self.cost_per_million is not None:
            out.append(
                f"cost: {self.cost_per_million:.4g} per 1M output tokens at {t.price_per_hour:g}/hour (one replica "
                "at the rate above)"
            )
        return out + self.notes


def meets_p99(summary: dict[str, Any], slos: dict[str, float]) -> bool:
    if not summary["completed"] or summary["failed"]:
        return False
    return all(p99(summary, k) <= v for k, v in slos.items() if k in ("ttft", "tpot"))


def capacity_p99(at_rate: Any, slos: dict[str, float], start: float, cap: float = math.inf) -> float:
    """The highest Poisson rate (within 10%) whose replay meets the SLOs at p99; 0 if a thousandth of
    `start` does not. A rate of `cap` or more that meets them is returned at once: the search only ever
    raises its lower end, so min(answer, cap) is the same as searching on (the doubling towards 1e6 a
    target that meets its SLOs even with the whole trace at once took, each a replay, saved)."""
    lo, hi = 0.0, max(start, 1e-3)
    while meets_p99(at_rate(hi), slos):
        if hi >= cap:
            return hi
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return hi
    floor = hi / 1000
    while hi - lo > 0.1 * hi and hi > floor:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets_p99(at_rate(mid), slos) else (lo, mid)
    return lo


@dataclass
class Trace:
    """What every target replays: the workload at the current settings, and its goals."""

    config: EngineConfig
    workload: Workload
    max_model_len: int
    request_rate: float | None  # Poisson arrivals in place of the trace's (None: the trace's own)
    trace_rate: float | None  # the rate the replicas are sized for
    slos: dict[str, float]
    largest_request: int


def answer(
    trace: Trace, cfg: ModelConfig, weight_dtype: str, target: Target, calibration: Calibration, label: str
) -> TargetAnswer:
    """The target's answers for the trace, its steps priced by the roofline with `calibration`."""
    from tokenmill.doctor.replays import Replays

    weight_bytes, compute = WEIGHT_DTYPES[weight_dtype]
    shape = ModelShape.of(cfg, weight_bytes)
    cost = RooflineCost(shape, target, calibration, compute)
    config = trace.config
    usable = USABLE * target.memory_bytes
    params = count_parameters(cfg)
    weights = params.linear * weight_bytes + params.other * max(2.0, weight_bytes)  # (embedding, norms: 16-bit)
    reserve = activation_reserve(cfg, config.max_num_batched_tokens)
    kv_memory = usable - weights - reserve
    kv_tokens = max(0, int(kv_memory // shape.kv_bytes_per_token))
    band = calibration.band if calibration.on == target.name else None  # (another machine's fit bounds nothing here)
    result = TargetAnswer(target, label, band, "", False)
    gb = 1e9
    head = f"{weight_dtype} weights {weights / gb:.2f} GB + activations {reserve / gb:.2f} GB of {usable / gb:.1f} GB "
    head += f"({USABLE:.0%} of {target.memory_bytes / gb:.0f} GB)"
    if kv_tokens < trace.largest_request:
        result.fit_line = (
            f"no: {head} leave {kv_tokens:,} KV tokens, the largest request needs {trace.largest_request:,}"
        )
        return result
    replays = Replays(
        config, int(kv_memory), shape.kv_bytes_per_token, trace.max_model_len, cost, trace.workload, trace.request_rate
    )
    ample = -(-trace.largest_request // config.block_size) * len(trace.workload.requests) + 1
    # (no more blocks than the whole trace at once can hold: a cache of millions of blocks replays alike, slower)
    blocks = max(1, min(kv_tokens // config.block_size, ample))
    peak = replays.engine({}, num_blocks=ample).record.peak_blocks * config.block_size
    result.fits = kv_tokens >= peak
    result.fit_line = (
        f"{'yes' if result.fits else 'no'}: {head} leave {kv_tokens:,} KV tokens "
        f"({shape.kv_bytes_per_token / 1e3:.1f} kB each); the trace peaks at {peak:,} at max_num_seqs "
        f"{config.max_num_seqs}" + ("" if result.fits else ": requests wait or are preempted")
    )
    result.summary = replays.run({}, num_blocks=blocks)[0]
    if calibration.on != target.name:
        result.best_case = replays.run({}, num_blocks=blocks, cost=RooflineCost(shape, target, IDEAL, compute))[0]
    _size(result, replays, trace, blocks)
    return result


def _size(result: TargetAnswer, replays: Any, trace: Trace, blocks: int) -> None:
    """Replicas for the trace's rate and the cost per 1M output tokens at one replica's capacity."""
    s = result.summary
    assert s is not None
    ceiling = replays.run({}, num_blocks=blocks, request_rate=math.inf)[0]["request_throughput"]
    if trace.slos:
        start = trace.trace_rate or max(s["request_throughput"], 1e-3)
        watch = SloWatch.of(trace.slos, 99)  # (the search's question: a replay past it stops there)
        rate = capacity_p99(
            lambda r: replays.run({}, num_blocks=blocks, request_rate=r, watch=watch)[0], trace.slos, start, cap=ceiling
        )
        result.replica_rate = min(rate, ceiling)
        if rate >= ceiling:
            result.notes.append(
                "the SLOs hold even with the whole trace at once: one replica's rate is its ceiling "
                f"({ceiling:.2f} requests/s, the trace's requests all at once)"
            )
    else:
        result.replica_rate = 0.8 * ceiling
    rate = trace.trace_rate
    result.replicas = math.ceil(rate / result.replica_rate) if rate and result.replica_rate > 0 else 1
    if result.replica_rate == 0:
        result.notes.append("no Poisson rate meets the SLOs at p99 on one replica")
    outputs = [r.max_tokens for r in trace.workload.requests]
    price = result.target.price_per_hour
    if price is not None and result.replica_rate > 0:
        per_hour = result.replica_rate * sum(outputs) / len(outputs) * 3600
        result.cost_per_million = price / per_hour * 1e6
