"""The doctor's simulator against measured runs: predicted vs measured TTFT p50, TPOT p50 and output tokens/s.

Workloads (`--workloads`, any of):
- `mixed`: the synthetic trace (log-normal input and output lengths: 64 requests, input 32-1024 tokens
  (at most the model's context less 256), output 8-256, Poisson arrivals at `--rate`);
- `azure-code`, `azure-conv`: windows of Azure's production traces (benchmarks/data/README.md: 300
  contiguous rows of each, from Azure/AzurePublicDataset), read as `tokenmill doctor --workload azure:FILE
  --window W --time-scale X --length-scale fit` reads them (doctor/traces/): lengths scaled so the 99th-
  percentile request fits the model's context, arrivals as in the trace, compressed by the time scale.

Three settings on each: continuous batching with 16 sequences, with 4, and static batching with 16. The
step-cost curve is probed (`doctor/step_cost.py`) on the setting's own engine right before each measured
run and calibrated on the trace's first 16 requests run for real (`doctor/calibrate.py`), as the doctor
does on the engine it reports on: a shared machine's speed drifts within minutes, a setting whose TTFT
is queueing (a saturated replica) magnifies a throughput error several-fold, and of several engines
in one process the first built can decode slower than the others (whatever the order they are built in;
cause not found), so one engine's probe does not price another's steps. Each run goes for
real (`bench.offline.run_offline`, an in-process engine) and through the doctor's own replay with the
cost model taken just before it (`diagnose.Replays`: the simulator, the real scheduler and KV manager,
fast-forward on); runs repeated and interleaved across workloads and settings, each figure the median
of the repeats (spread shown), the error the median of the repeats' own errors. And the cost model
apart from the schedule: each measured run's own steps (`calibrate.StepLog`), summed measured time over
the time the cost model gives them. And, for comparison, the replay without the after-prompt term
(`StepCost.after_prompt`: the first decode step after a prompt step priced as a steady one, as before that
term), its probe the same and calibrated its own way on the same logged steps: its errors, in the last
column.

Writes benchmarks/results/doctor_sim_traces.json (`--out`; the SmolLM2 synthetic rows of RESULTS.md are
in doctor_sim.json) and prints its table for benchmarks/RESULTS.md.

Usage: python benchmarks/doctor_sim.py [--model DIR] [--workloads mixed,azure-code,azure-conv] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT

from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import Workload, WorkloadSpec, build_workload
from tokenmill.config import EngineConfig
from tokenmill.doctor.calibrate import StepLog, rescaled, run_head
from tokenmill.doctor.diagnose import Replays
from tokenmill.doctor.step_cost import StepCost, probe
from tokenmill.doctor.traces.load import TraceFlags, load_workload
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.kernels.cpu_build import cpu_flags

DATA = ROOT / "data"
SETTINGS = {
    "continuous, 16 seqs": {"max_num_seqs": 16},
    "continuous, 4 seqs": {"max_num_seqs": 4},
    "static, 16 seqs": {"max_num_seqs": 16, "scheduling": "static"},
}
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "output_throughput")


@dataclass(frozen=True)
class TraceWindow:
    """A public trace's window as the doctor's flags give it."""

    kind: str  # "azure"
    path: Path
    window: str  # START:END seconds of the file
    time_scale: float


TRACES = {
    "azure-code": TraceWindow("azure", DATA / "azure_code_window.csv", "0:10", 1.0),
    "azure-conv": TraceWindow("azure", DATA / "azure_conv_window.csv", "0:10", 1.0),
}
WORKLOADS = ("mixed", *TRACES)


def figures(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_ms": summary["ttft"]["median"],
        "tpot_p50_ms": summary["tpot"]["median"],
        "output_throughput": summary["output_throughput"],
    }


@dataclass
class Case:
    """One workload: its requests, the rate it arrives at (None: its own arrival times), what it is."""

    workload: Workload
    rate: float | None
    notes: list[str] = field(default_factory=list)


@dataclass
class Runs:
    """Every repeat's figures, by "workload / setting", and each repeat's probed cost model."""

    measured: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    predicted: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    before: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # without the after-prompt term
    step_level: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    probes: list[StepCost] = field(default_factory=list)
    probes_before: list[StepCost] = field(default_factory=list)  # the same, calibrated without the after-prompt term
    loads: list[float] = field(default_factory=list)  # the 1-minute load average after each measured run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=4.0, help="mixed: requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=64, help="mixed: requests")
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--dtype", default="float32", help="float32: no bfloat16 matmul on an AVX2-only CPU")
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch threads (1: steady on a shared machine)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}")
    parser.add_argument("--settings", default=";".join(SETTINGS), help="any of the settings, by name, ';'-separated")
    parser.add_argument("--out", default=str(RESULTS / "doctor_sim_traces.json"))
    args = parser.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS] + [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown workloads or settings: {', '.join(unknown)}")
    return args


def build_case(name: str, engine: LLMEngine, args: argparse.Namespace) -> Case:
    """The workload `name` for `engine`'s model and context."""
    if name == "mixed":
        top = max(64, min(1024, engine.max_model_len - 256))
        spec = WorkloadSpec("mixed", args.requests, seed=0, input_len=(32, top), output_len=(8, 256))
        return Case(build_workload(spec, engine.tokenizer), args.rate)
    t = TRACES[name]
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    spec = WorkloadSpec(f"{t.kind}:{t.path}", None, seed=0)
    flags = TraceFlags(t.window, t.time_scale, "fit")
    workload, info = load_workload(spec, engine.tokenizer, engine.max_model_len, vocab, flags)
    assert info is not None
    return Case(workload, None, [n.replace(f"{ROOT.parent}/", "") for n in info.notes])


def run_once(engine: LLMEngine, key: str, repeat: int, case: Case, runs: Runs) -> None:
    """Probe and calibrate on `engine`, run the workload for real, then through the doctor's replay."""
    raw = probe(engine)
    head = run_head(engine, case.workload, case.rate)  # (as `calibrate` does)
    cost = rescaled(head, raw)
    # the replay as it was before the after-prompt term (step_cost.py), calibrated its own way on the same steps
    before = rescaled(head, dataclasses.replace(raw, after_prompt_tokens=[], after_prompt_seconds=[]))
    runs.probes.append(cost)
    runs.probes_before.append(before)
    log = StepLog(engine)
    run = run_offline(engine, case.workload, key, repeat, request_rate=case.rate)
    log.close()
    runs.loads.append(os.getloadavg()[0])
    engine.reset_prefix_cache()
    runs.step_level.setdefault(key, []).append({k: v[0] for k, v in log.measured_over_predicted(cost).items()})
    runs.measured.setdefault(key, []).append(figures(summarize(run.records, run.duration_s)))
    replays = Replays.of(engine, cost, case.workload, case.rate)
    runs.predicted.setdefault(key, []).append(figures(replays({})))
    runs.before.setdefault(key, []).append(figures(Replays.of(engine, before, case.workload, case.rate)({})))
    runs.steps[key] = replays.engine({}).record.steps
    print(f"{key} #{repeat} (probe {cost.probe_seconds:.1f} s): measured {runs.measured[key][-1]}, "
          f"predicted {runs.predicted[key][-1]}, the run's own steps measured/predicted "
          f"{runs.step_level[key][-1]}", flush=True)  # fmt: skip


def summarize_rows(runs: Runs, settings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per workload and setting: the median of the repeats (and their range) measured, predicted, and the error."""
    rows: dict[str, Any] = {}
    for key, measured in runs.measured.items():
        sims = runs.predicted[key]
        errors = [{m: p[m] / r[m] - 1 for m in METRICS} for r, p in zip(measured, sims, strict=True)]
        olds = [{m: p[m] / r[m] - 1 for m in METRICS} for r, p in zip(measured, runs.before[key], strict=True)]
        rows[key] = {
            "settings": settings[key.split(" / ", 1)[1]],
            "measured": {m: statistics.median(r[m] for r in measured) for m in METRICS},
            "measured_range": {m: [min(r[m] for r in measured), max(r[m] for r in measured)] for m in METRICS},
            "predicted": {m: statistics.median(p[m] for p in sims) for m in METRICS},
            "predicted_range": {m: [min(p[m] for p in sims), max(p[m] for p in sims)] for m in METRICS},
            "error": {m: statistics.median(e[m] for e in errors) for m in METRICS},
            "error_range": {m: [min(e[m] for e in errors), max(e[m] for e in errors)] for m in METRICS},
            "within_15pct": all(abs(statistics.median(e[m] for e in errors)) <= 0.15 for m in METRICS),
            # the replay without the after-prompt term (the decode step after a prompt step priced as a steady one)
            "predicted_before": {m: statistics.median(p[m] for p in runs.before[key]) for m in METRICS},
            "error_before": {m: statistics.median(e[m] for e in olds) for m in METRICS},
            "simulated_steps": runs.steps[key],
            # each measured run's own steps through the cost model: summed measured / predicted time
            "own_steps_measured_over_predicted": {
                kind: statistics.median(r[kind] for r in runs.step_level[key] if kind in r)
                for kind in ("decode", "other", "all")
                if any(kind in r for r in runs.step_level[key])
            },
        }
    return rows


def build_result(args: argparse.Namespace, cases: dict[str, Case], runs: Runs, rows: dict[str, Any]) -> dict[str, Any]:
    """The JSON written: the machine, the run's settings, the middle probe's cost model, the rows."""
    cost = runs.probes[len(runs.probes) // 2]
    workloads = {}
    for name, case in cases.items():
        described = case.workload.describe()
        described["name"] = described["name"].replace(f"{ROOT.parent}/", "")
        workloads[name] = {**described, "request_rate": case.rate, "trace_notes": case.notes}
        if name in TRACES:
            t = TRACES[name]
            workloads[name]["doctor_flags"] = f"--window {t.window} --time-scale {t.time_scale:g} --length-scale fit"
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags()},
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "cpu_threads": args.cpu_threads,
        "workloads": workloads,
        "repeats": args.repeats,
        "step_cost": {  # the middle probe's
            "prompt_tokens": cost.prompt_tokens,
            "prompt_ms": [s * 1e3 for s in cost.prompt_seconds],
            "decode_batch": cost.decode_batch,
            "decode_ms": [s * 1e3 for s in cost.decode_seconds],
            "per_request_ms": cost.per_request * 1e3,
            "per_decode_key_ns": cost.per_decode_key * 1e9,
            "per_prompt_pair_ns": cost.per_prompt_pair * 1e9,
            "per_mixed_key_ns": cost.per_mixed_key * 1e9,
            "after_prompt_tokens": cost.after_prompt_tokens,  # the first decode step after such a prompt step ...
            "after_prompt_ms": [s * 1e3 for s in cost.after_prompt_seconds],  # ... costs this much more
            "probe_seconds": cost.probe_seconds,
            "calibration": cost.calibration,
        },
        "calibrations": [c.calibration for c in runs.probes],
        "calibrations_before": [c.calibration for c in runs.probes_before],  # without the after-prompt term
        "after_prompt_ms_at_256": [c.after_prompt(256) * 1e3 for c in runs.probes],  # (the first decode step's)
        "after_prompt_decay": [c.after_prompt_decay for c in runs.probes],
        "load_average_1min": runs.loads,  # the machine's load after each measured run (other jobs on it)
        "probe_decode_ms_at_16": [c.decode_step(16, 128) * 1e3 for c in runs.probes],  # how far the machine drifted
        "rows": rows,
    }


def print_table(rows: dict[str, Any]) -> None:
    print("| workload / setting | TTFT p50 (ms) measured / predicted | TPOT p50 (ms) | output tokens/s "
          "| own steps decode / other / all | error without the after-prompt term |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for key, r in rows.items():
        cells = [
            f"{r['measured'][m]:.1f} / {r['predicted'][m]:.1f} ({r['error'][m] * 100:+.0f}% "
            f"[{r['error_range'][m][0] * 100:+.0f}..{r['error_range'][m][1] * 100:+.0f}])"
            for m in METRICS
        ]
        own = r["own_steps_measured_over_predicted"]
        steps = " / ".join(f"{own[k]:.2f}" if k in own else "-" for k in ("decode", "other", "all"))
        old = " / ".join(f"{r['error_before'][m] * 100:+.0f}%" for m in METRICS)
        print(f"| {key} | " + " | ".join(cells) + f" | {steps} | {old} |")


def main() -> None:
    args = parse_args()
    base = {"model": args.model, "dtype": args.dtype, "enable_prefix_caching": False, "seed": 0}
    if args.cpu_threads is not None:
        base["cpu_threads"] = args.cpu_threads
    engines = {name: LLMEngine(EngineConfig.from_kwargs(**base, **SETTINGS[name])) for name in args.settings}
    first = next(iter(engines.values()))
    cases = {name: build_case(name, first, args) for name in args.workloads}
    runs = Runs()
    for repeat in range(args.repeats):  # interleaved across workloads and settings
        for workload, case in cases.items():
            for name, engine in engines.items():
                run_once(engine, f"{workload} / {name}", repeat, case, runs)
    rows = summarize_rows(runs, SETTINGS)
    Path(args.out).write_text(json.dumps(build_result(args, cases, runs, rows), indent=2) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
