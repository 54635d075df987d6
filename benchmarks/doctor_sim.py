"""The doctor's simulator against measured runs: predicted vs measured TTFT p50, TPOT p50 and output tokens/s.

SmolLM2-135M-Instruct in bfloat16 (the default served model), the `mixed` workload (log-normal input and
output lengths: 64 requests, input 32-1024, output 8-256 tokens, Poisson arrivals), three settings:
continuous batching with 16 sequences, continuous batching with 4, and static batching with 16. The
step-cost curve is probed (`doctor/step_cost.py`) on the setting's own engine right before each measured
run and calibrated on the trace's first 16 requests run for real (`doctor/calibrate.py`), as the doctor
does on the engine it reports on: a shared machine's speed drifts within minutes, a setting whose TTFT
is queueing (a saturated replica) magnifies a throughput error several-fold, and of several engines
in one process the first built can decode slower than the others (whatever the order they are built in;
cause not found), so one engine's probe does not price another's steps. Each run goes for
real (`bench.offline.run_offline`, an in-process engine) and through the simulator with the cost model
taken just before it (`doctor/simulator.py`: the real scheduler and KV manager, the probed costs
instead of the model); runs repeated and interleaved across settings, each figure the median of the
repeats (spread shown), the error the median of the repeats' own errors. And the cost model apart
from the schedule: each measured run's own steps (`calibrate.StepLog`), summed measured time over the
time the cost model gives them.

Writes benchmarks/results/doctor_sim.json and prints its table in benchmarks/RESULTS.md.

Usage: python benchmarks/doctor_sim.py [--repeats 5] [--rate 4]
"""

from __future__ import annotations

import argparse
import json
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
from tokenmill.doctor.calibrate import StepLog, calibrate
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.step_cost import StepCost, probe
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels.cpu_build import cpu_flags

SMOLLM2 = ROOT.parent / "models" / "smollm2-135m-instruct"
SETTINGS = {
    "continuous, 16 seqs": {"max_num_seqs": 16},
    "continuous, 4 seqs": {"max_num_seqs": 4},
    "static, 16 seqs": {"max_num_seqs": 16, "scheduling": "static"},
}
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "output_throughput")


def figures(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_ms": summary["ttft"]["median"],
        "tpot_p50_ms": summary["tpot"]["median"],
        "output_throughput": summary["output_throughput"],
    }


@dataclass
class Runs:
    """Every repeat's figures, setting by setting, and each repeat's probed cost model."""

    measured: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {name: [] for name in SETTINGS})
    predicted: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {name: [] for name in SETTINGS})
    step_level: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {name: [] for name in SETTINGS})
    steps: dict[str, int] = field(default_factory=dict)
    probes: list[StepCost] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--out", default=str(RESULTS / "doctor_sim.json"))
    return parser.parse_args()


def run_once(engine: LLMEngine, name: str, repeat: int, workload: Workload, rate: float, runs: Runs) -> None:
    """Probe and calibrate on `engine`, run the workload for real, then through the simulator."""
    cost = calibrate(engine, workload, probe(engine), rate)
    runs.probes.append(cost)
    log = StepLog(engine)
    run = run_offline(engine, workload, name, repeat, request_rate=rate)
    log.close()
    runs.step_level[name].append({k: v[0] for k, v in log.measured_over_predicted(cost).items()})
    runs.measured[name].append(figures(summarize(run.records, run.duration_s)))
    sim = SimulatedEngine(engine.config, engine.core.num_blocks, engine.max_model_len, cost)
    replay = run_offline(sim, workload, name, request_rate=rate, clock=sim.clock, sleep=sim.sleep)
    runs.predicted[name].append(figures(summarize(replay.records, replay.duration_s)))
    runs.steps[name] = sim.record.steps
    print(f"{name} #{repeat} (probe {cost.probe_seconds:.1f} s): measured {runs.measured[name][-1]}, "
          f"predicted {runs.predicted[name][-1]}, the run's own steps measured/predicted "
          f"{runs.step_level[name][-1]}")  # fmt: skip


def summarize_rows(runs: Runs) -> dict[str, Any]:
    """Per setting: the median of the repeats (and their range) measured, predicted, and the error."""
    rows: dict[str, Any] = {}
    for name in SETTINGS:
        measured, sims = runs.measured[name], runs.predicted[name]
        errors = [{m: p[m] / r[m] - 1 for m in METRICS} for r, p in zip(measured, sims, strict=True)]
        rows[name] = {
            "settings": SETTINGS[name],
            "measured": {m: statistics.median(r[m] for r in measured) for m in METRICS},
            "measured_range": {m: [min(r[m] for r in measured), max(r[m] for r in measured)] for m in METRICS},
            "predicted": {m: statistics.median(p[m] for p in sims) for m in METRICS},
            "predicted_range": {m: [min(p[m] for p in sims), max(p[m] for p in sims)] for m in METRICS},
            "error": {m: statistics.median(e[m] for e in errors) for m in METRICS},
            "error_range": {m: [min(e[m] for e in errors), max(e[m] for e in errors)] for m in METRICS},
            "simulated_steps": runs.steps[name],
            # each measured run's own steps through the cost model: summed measured / predicted time
            "own_steps_measured_over_predicted": {
                kind: statistics.median(r[kind] for r in runs.step_level[name] if kind in r)
                for kind in ("decode", "other", "all")
            },
        }
    return rows


def build_result(args: argparse.Namespace, workload: Workload, runs: Runs, rows: dict[str, Any]) -> dict[str, Any]:
    """The JSON written: the machine, the run's settings, the middle probe's cost model, the rows."""
    cost = runs.probes[len(runs.probes) // 2]
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags()},
        "model": Path(args.model).name,
        "workload": workload.describe(),
        "request_rate": args.rate,
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
            "probe_seconds": cost.probe_seconds,
            "calibration": cost.calibration,
        },
        "calibrations": [c.calibration for c in runs.probes],
        "probe_decode_ms_at_16": [c.decode_step(16, 128) * 1e3 for c in runs.probes],  # how far the machine drifted
        "rows": rows,
    }


def print_table(rows: dict[str, Any]) -> None:
    print("| setting | TTFT p50 measured / predicted | TPOT p50 | output tokens/s | own steps decode / other / all |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [
            f"{r['measured'][m]:.1f} / {r['predicted'][m]:.1f} ({r['error'][m] * 100:+.0f}% "
            f"[{r['error_range'][m][0] * 100:+.0f}..{r['error_range'][m][1] * 100:+.0f}])"
            for m in METRICS
        ]
        own = r["own_steps_measured_over_predicted"]
        print(f"| {name} | " + " | ".join(cells) + f" | {own['decode']:.2f} / {own['other']:.2f} / {own['all']:.2f} |")


def main() -> None:
    args = parse_args()
    base = {"model": args.model, "dtype": "bfloat16", "enable_prefix_caching": False, "seed": 0}
    engines = {name: LLMEngine(EngineConfig.from_kwargs(**base, **s)) for name, s in SETTINGS.items()}
    spec = WorkloadSpec("mixed", args.requests, seed=0, input_len=(32, 1024), output_len=(8, 256))
    workload = build_workload(spec, next(iter(engines.values())).tokenizer)
    runs = Runs()
    for repeat in range(args.repeats):  # interleaved across settings
        for name, engine in engines.items():
            run_once(engine, name, repeat, workload, args.rate, runs)
    rows = summarize_rows(runs)
    Path(args.out).write_text(json.dumps(build_result(args, workload, runs, rows), indent=2) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
