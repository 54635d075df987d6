"""`tokenmill doctor`: the questions asked in order of a user's workload, answered from measurements.

Loads the model with the current settings (an `LLMEngine`), measures its step costs on this machine
(`step_cost.probe`, calibrated on the trace's first requests by `calibrate.calibrate`, unless given),
reads the workload (a built-in one or a JSONL trace, tokenized), and replays it through the simulator
(`simulator.SimulatedEngine`: the real scheduler and KV manager) for the current settings and each
alternative a question weighs. Each question's module turns the numbers into a `Finding`;
`write_report` writes report.md, report.html (with the charts of plots.py), report.json and
recommended.yaml.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tokenmill.bench.records import RequestRecord
from tokenmill.bench.workloads import Workload
from tokenmill.config import EngineConfig
from tokenmill.doctor.draft_check import draft_agreement
from tokenmill.doctor.findings import Finding, p50, recommended_settings, render_markdown, serve_flags
from tokenmill.doctor.latency import latency_finding
from tokenmill.doctor.model_fit import STORAGE, fit_finding
from tokenmill.doctor.plots import hit_rate_chart, latency_cdfs, lengths_chart, render_html, step_cost_chart
from tokenmill.doctor.prefix_report import TraceRequest, block_chains, replay_kv_cache
from tokenmill.doctor.quant_check import quality_line, speed_lines
from tokenmill.doctor.redundancy import redundancy_finding
from tokenmill.doctor.replays import Replays, kv_value_bytes
from tokenmill.doctor.scale import capacity, scale_finding
from tokenmill.doctor.simulator import WatchedKV
from tokenmill.doctor.slo_watch import SloWatch
from tokenmill.doctor.stall import StallMeasurement, measure_stall
from tokenmill.doctor.step_cost import StepCost
from tokenmill.doctor.traces.shape import TraceInfo
from tokenmill.doctor.verify import (
    ALL,
    CURRENT,
    SIM_TOLERANCE,
    Verified,
    apply_verdicts,
    headline,
    offline_runner,
    runs_needed,
    verify,
    window,
    window_size,
)
from tokenmill.doctor.workload_shape import fragmentation_finding, length_finding

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine


@dataclass
class Diagnosis:
    model: str
    settings: EngineConfig
    workload: str
    cost: StepCost
    current: dict[str, Any]  # the simulator's summary of the trace at the current settings
    findings: list[Finding] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    hit_curve: list[tuple[int, float]] = field(default_factory=list)  # (cache blocks, LRU prefix-hit rate)
    cache_blocks: int = 0
    runs: dict[str, list[RequestRecord]] = field(default_factory=dict)  # label -> the replay's records
    verified: list[Verified] = field(default_factory=list)  # --verify's runs
    verified_requests: int = 0  # --verify ran the trace's first this many requests
    trace: TraceInfo | None = None  # a trace read by doctor/traces/: what the report says of it


def trace_rate(workload: Workload, request_rate: float | None) -> float | None:
    """Requests a second the trace arrives at: `request_rate`, else its own arrival times' (None: all at once)."""
    if request_rate is not None:
        return request_rate
    times = sorted(r.arrival_s for r in workload.requests if r.arrival_s is not None)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def diagnose(
    engine: LLMEngine,
    workload: Workload,
    cost: StepCost,
    memory: int | None = None,
    slos: dict[str, float] | None = None,
    request_rate: float | None = None,
    link_gbps: float = 10.0,
    cost_per_hour: float | None = None,
    measure_quantization: bool = True,
    draft: LLMEngine | None = None,
    measure_stalls: bool = True,
    trace_info: TraceInfo | None = None,
    progress: Callable[[str], None] | None = None,
) -> Diagnosis:
    """The findings for `workload` served by `engine`'s settings (its model, its KV cache); `memory`: the
    bytes for weights and KV cache (default: what the current settings take); `measure_quantization`:
    time (and for a recommended one, evaluate) weight-only quantization at the trace's batch, which
    loads the model again for each way of storing it that is weighed; `draft`: a draft model's engine, its
    agreement with the target on the trace and its decode steps measured (question 5); `measure_stalls`:
    time the trace's decodes with and without its prompts arriving on `engine` (question 6); `trace_info`:
    what the report says of a trace read by doctor/traces/; `progress`: told of each replay as it ends."""
    config = engine.config
    cfg = engine.model_config
    worker = engine.core.worker
    replays = Replays.of(engine, cost, workload, request_rate, progress)
    token_bytes, kv_memory, num_blocks = replays.kv_token_bytes, replays.kv_memory, engine.core.num_blocks
    value_bytes = kv_value_bytes(engine)
    budget = memory if memory is not None else worker.weight_bytes + kv_memory
    current = replays({})

    requests = workload.requests
    trace = [TraceRequest(r.token_ids(engine.tokenizer), None, r.max_tokens) for r in requests]
    prompts = [len(t.token_ids) for t in trace]
    outputs = [r.max_tokens for r in requests]
    ids = [t.token_ids for t in trace]
    chains = block_chains(trace, config.block_size)  # (hashed once: question 2's replay and the hit-rate curve's)
    agreement = draft_agreement(engine, draft, ids, cost.decode_batch) if draft is not None else None
    replayed = replays.engine({}).record
    busy = [b for b in replayed.batch_sizes if b > 0]
    batch = int(statistics.median(busy)) if busy else 1  # the trace's decode batch: the replay's median step
    totals = [p + o for p, o in zip(prompts, outputs, strict=True)]
    peak = _peak_tokens(replays, totals, config.block_size)
    # as many prompts arriving as the replay's steps carried
    share = 1 - replayed.decode_only_steps / max(1, replayed.steps)
    stall = measure_stall(engine, prompts, batch, share, int(statistics.median(prompts))) if measure_stalls else None
    storage = _storage(config, str(worker.dtype))
    prefix = redundancy_finding(
        trace, config.block_size, num_blocks, config.enable_prefix_caching, config.max_num_batched_tokens, replays,
        engine.tokenizer, chains,
    )  # fmt: skip
    findings = [
        fit_finding(
            cfg, storage, budget, value_bytes, config.max_num_batched_tokens, max(totals), peak, config.max_num_seqs
        ),
        prefix,
        length_finding(prompts, outputs, config.scheduling, replays),
        fragmentation_finding(prompts, outputs, engine.max_model_len, config.block_size, current["kv_live_share"]),
        latency_finding(ids, current, batch, cost, slos or {}, config.speculative_config, agreement),
        _scale(
            replays, workload, prompts, outputs, token_bytes, link_gbps, request_rate, slos or {}, cost_per_hour, stall
        ),
    ]
    if measure_quantization:
        _check_quantization(findings[0], config, storage, batch)
    if current["failed"]:
        errors = ", ".join(f"{n} x {e}" for e, n in current["errors"].items())
        findings[0].pitfalls.append(f"{current['failed']} of {len(requests)} requests cannot run here: {errors}")
    _predict_gains(findings, replays, current)
    curve = _hit_curve(trace, config.block_size, num_blocks, sum(prompts), chains)
    runs = _runs(replays, recommended_settings(findings))
    if trace_info is not None:
        _trace_evidence(findings[1], trace_info, current, config.block_size)
    return Diagnosis(
        config.model, config, workload.spec.name, cost, current, findings, prompts, outputs, curve, num_blocks, runs,
        trace=trace_info,
    )  # fmt: skip


def _trace_evidence(prefix: Finding, info: TraceInfo, current: dict[str, Any], block_size: int) -> None:
    """Question 2 gains the trace's own block-level reuse beside the replayed hits, and a pitfall where a
    scaled block id is smaller than a KV block."""
    prefix.evidence += [*info.prefix_lines, _replayed_hits(current)]
    warning = info.block_warning(block_size, current.get("cached_share"))
    prefix.pitfalls += [warning] if warning else []


def _replayed_hits(current: dict[str, Any]) -> str:
    share = current.get("cached_share")
    return f"replayed at the current settings (the simulator's run): {share or 0:.1%} of prompt tokens from the cache"


def _runs(replays: Replays, settings: dict[str, Any]) -> dict[str, list[RequestRecord]]:
    """The replayed requests with the current settings, and with the recommended ones where the replay can run them."""
    runs = {"current": replays.records_of({})}
    if settings and "kv_cache_memory" not in settings:
        runs["recommended"] = replays.records_of(settings)
    return runs


def _peak_tokens(replays: Replays, totals: list[int], block_size: int) -> int:
    """The most KV tokens the trace holds at once, replayed with blocks for every request (none evicted):
    the current replay's peak where its KV manager saw nothing such a cache would do otherwise."""
    ample = sum(-(-t // block_size) for t in totals) + 1
    current = replays.engine({})
    if isinstance(current.scheduler.kv, WatchedKV) and current.scheduler.kv.same_with(ample):
        return current.record.peak_blocks * block_size
    return replays.engine({}, num_blocks=ample).record.peak_blocks * block_size


def _storage(config: EngineConfig, dtype: str) -> str:
    """How the weights are stored, in the names question 1 weighs."""
    storage = config.quantization if config.quantization in ("int8", "int4") else dtype.split(".")[-1]
    return storage if storage in ("float32", "bfloat16", "int8", "int4") else "bfloat16"


def _predict_gains(findings: list[Finding], replays: Replays, current: dict[str, Any]) -> None:
    """A simulated gain for each finding whose settings the replay can run (not a KV cache size)."""
    for f in findings:
        if f.settings and f.predicted_gain is None and "kv_cache_memory" not in f.settings:
            after = replays(f.settings)
            f.predicted_gain = (
                f"output tokens/s {current['output_throughput']:.1f} -> {after['output_throughput']:.1f}, TTFT p50 "
                f"{p50(current, 'ttft'):.0f} -> {p50(after, 'ttft'):.0f} ms (simulated)"
            )


def _hit_curve(
    trace: list[TraceRequest], block_size: int, num_blocks: int, prompt_tokens: int, chains: list[list[bytes]]
) -> list[tuple[int, float]]:
    """The prefix-cache hit share of the trace's prompt tokens at fractions of the current cache."""
    sizes = sorted({max(1, int(num_blocks * f)) for f in (1 / 256, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 1)})
    return [(n, replay_kv_cache(trace, block_size, n, chains=chains)[0] / max(1, prompt_tokens)) for n in sizes]


def _check_quantization(fit: Finding, config: EngineConfig, storage: str, batch: int) -> None:
    """Weight-only quantization judged at the trace's batch: the one in use (against 16-bit weights) or
    the one question 1 recommends (against the current storage, with its quality)."""
    proposed = fit.settings.get("quantization")
    if storage in ("int8", "int4"):
        quantized, other, settings = storage, "bfloat16", {}
    elif proposed in ("int8", "int4"):
        quantized, other, settings = proposed, storage, fit.settings
    else:
        return
    times = speed_lines(config, {quantized: STORAGE[quantized][0], other: STORAGE[other][0]}, batch)
    speedup = times[other] / times[quantized]
    fit.evidence.append(
        f"a decode step at the trace's batch ({batch}), measured: {quantized} {times[quantized] * 1e3:.1f} ms, "
        f"{other} {times[other] * 1e3:.1f} ms ({speedup:.2f}x)"
    )
    if settings:
        fit.evidence.append(quality_line(config.model, quantized))
    if round(speedup, 2) < 1.05:  # (as printed: never "1.05x" and "no speed-up" together)
        fit.pitfalls.append(
            f"weight-only {quantized} brings no speed-up at the trace's batch of {batch} ({speedup:.2f}x {other}): "
            "it saves memory only"
            + ("; with memory to spare, 16-bit weights are as fast and exact" if not settings else "")
        )


def _scale(
    replays: Replays,
    workload: Workload,
    prompts: list[int],
    outputs: list[int],
    token_bytes: float,
    link_gbps: float,
    request_rate: float | None,
    slos: dict[str, float],
    cost_per_hour: float | None,
    stall: StallMeasurement | None,
) -> Finding:
    current = replays({})
    decode_only = replays.run({}, cost=replays.decode_only)[0]
    budget = replays.config.max_num_batched_tokens
    smaller = {b: replays({"max_num_batched_tokens": b}) for b in (budget // 2, budget // 4) if b >= 16}
    per_request = sum(outputs) / len(outputs)
    rate = trace_rate(workload, request_rate)
    if slos:
        start = rate or max(current["request_throughput"], 1e-3)
        watch = SloWatch.of(slos, 90)  # (the search's question: a replay past it stops there)
        replica = capacity(lambda r: replays.run({}, request_rate=r, watch=watch)[0], slos, start)
    else:  # the ceiling: the whole trace at once
        replica = 0.8 * replays.run({}, request_rate=math.inf)[0]["request_throughput"]
    return scale_finding(
        current, decode_only, smaller, budget, prompts, token_bytes, link_gbps, replica, rate, slos, cost_per_hour,
        per_request, stall,
    )  # fmt: skip


def write_report(diagnosis: Diagnosis, out: Path) -> str:
    """report.md, report.html, the charts, report.json and recommended.yaml into `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    c, cost = diagnosis.current, diagnosis.cost
    preamble = [
        f"Model `{diagnosis.model}`, workload `{diagnosis.workload}`: {c['completed']} requests.",
        f"Step costs measured on this machine in {cost.probe_seconds:.1f} s: a decode step of 1 request "
        f"{cost.decode_step(1, 128) * 1e3:.1f} ms, of {cost.decode_batch[-1]} requests "
        f"{cost.decode_step(cost.decode_batch[-1], 128) * 1e3:.1f} ms (context 128); a {cost.prompt_tokens[-1]}-token "
        f"prompt step {cost.prompt_seconds[-1] * 1e3:.1f} ms"
        + (
            f"; calibrated on the trace's first requests run for real (decode steps x{cost.calibration['decode']:.2f}, "
            f"the others x{cost.calibration['other']:.2f})."
            if cost.calibration
            else "."
        ),
        f"The trace at the current settings, simulated: output {c['output_throughput']:.1f} tokens/s, TTFT p50 "
        f"{p50(c, 'ttft'):.0f} ms, TPOT p50 {p50(c, 'tpot'):.1f} ms"
        if c.get("tpot")
        else "",
        *(diagnosis.trace.notes if diagnosis.trace is not None else []),
    ]
    verified = diagnosis.verified
    if verified and verified[0].label == CURRENT:
        preamble.append(
            f"Verified (--verify), on the trace's first {diagnosis.verified_requests} requests: {verified[0].line()}."
        )
    elif verified:
        preamble.append(
            f"Verified (--verify): each recommendation run against the current settings on the trace's first "
            f"{diagnosis.verified_requests} requests, "
            f"{len(verified[0].gains['output_throughput'])} repeats interleaved, every run from an empty prefix "
            "cache; kept: " + (", ".join(v.label for v in verified if v.kept) or "none") + "."
        )
        preamble += [f"Verified: {v.line()}{sim_note(v)}." for v in verified if v.label == ALL]
    preamble = [p for p in preamble if p]
    charts = [
        lengths_chart(diagnosis.prompt_lens, diagnosis.output_lens, out / "lengths.png"),
        hit_rate_chart(diagnosis.hit_curve, diagnosis.cache_blocks, out / "prefix_hit_rate.png"),
        step_cost_chart(cost, out / "step_cost.png"),
        latency_cdfs(diagnosis.runs, out / "latency_cdf.png"),
    ]
    text = render_markdown("tokenmill doctor", preamble, diagnosis.findings)
    text += "\n" + "\n".join(f"![{c.stem}]({c.name})" for c in charts) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(render_html("tokenmill doctor", preamble, diagnosis.findings, charts))
    settings = recommended_settings(diagnosis.findings)
    (out / "recommended.yaml").write_text(
        yaml.safe_dump(settings, sort_keys=False) if settings else "# nothing to change\n"
    )
    record = {
        "model": diagnosis.model,
        "workload": diagnosis.workload,
        "current": {k: v for k, v in c.items() if k != "errors"},
        "findings": [dataclasses.asdict(f) for f in diagnosis.findings],
        "recommended": settings,
        "serve_flags": serve_flags(settings),
        "step_cost": dataclasses.asdict(cost),
        "trace": dataclasses.asdict(diagnosis.trace) if diagnosis.trace is not None else None,
        "verified": [
            {**dataclasses.asdict(v), "sim_error": {m: v.sim_error(m) for m in v.measured}} for v in diagnosis.verified
        ],
    }
    (out / "report.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return text


def sim_note(v: Verified) -> str:
    """The simulator's errors on `v`'s runs where past SIM_TOLERANCE, for the report ("" when none)."""
    off = [f"{m.replace('_', ' ')} {v.sim_error(m):+.0%}" for m in v.measured if abs(v.sim_error(m)) > SIM_TOLERANCE]
    return f"; the simulator was off by {', '.join(off)}: the cost model needs a new probe" if off else ""


def verify_findings(
    engine: LLMEngine,
    diagnosis: Diagnosis,
    workload: Workload,
    request_rate: float | None,
    budget_s: float,
    repeats: int,
) -> list[Verified]:
    """`--verify`: the diagnosis's recommendations run against `engine`'s settings on a sample of the
    trace sized to `budget_s` (verify.py), the findings updated with what was kept."""
    cost = diagnosis.cost
    runs = runs_needed(sum(1 for f in diagnosis.findings if f.settings), repeats)

    def duration(n: int) -> float:
        return float(Replays.of(engine, cost, window(workload, n), request_rate)({})["duration_s"])

    count = window_size(duration, len(workload.requests), runs, budget_s)
    part = window(workload, count)
    replays = Replays.of(engine, cost, part, request_rate)

    def predict(settings: dict[str, Any], _: Workload) -> dict[str, float]:
        return headline(replays(settings))

    def build(settings: dict[str, Any]) -> LLMEngine:
        from tokenmill.engine.engine import LLMEngine

        return LLMEngine(dataclasses.replace(engine.config, **settings))

    verified = verify(engine, build, part, diagnosis.findings, predict, offline_runner(request_rate), repeats)
    apply_verdicts(diagnosis.findings, verified)
    diagnosis.verified = verified
    diagnosis.verified_requests = count
    return verified
