"""`--target`'s part of the doctor's run: this machine's roofline measured and calibrated, each target
answered (targets.py), and the answers written beside the report.

Order: `measure_here` (this machine's bandwidth and peak), `calibrate_here` (the efficiency factors and
overheads that bring that roofline to the probe's steps), a `--target-steps` file's own calibration
where given; then each target's answers. `calibration.json` in the report folder stores the factors
with where they came from; report.md gains a "Targets" section and report.json a "targets" list.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.bench.workloads import Workload
from tokenmill.doctor.findings import p50
from tokenmill.doctor.hardware import load_target, measure_here
from tokenmill.doctor.roofline import Calibration, ModelShape, calibrate_here
from tokenmill.doctor.step_cost import StepCost
from tokenmill.doctor.targets import TargetAnswer, Trace, answer, read_measured_steps, read_model_config

if TYPE_CHECKING:
    from tokenmill.doctor.diagnose import Diagnosis
    from tokenmill.engine.engine import LLMEngine


@dataclass
class TargetOptions:
    targets: list[str]  # here, a built-in name, or a YAML file
    model_config: str | None = None  # a config.json (or folder) for a model whose weights are not here
    weight_dtype: str = "bfloat16"  # the target's weights: bfloat16, fp8 or int8
    price_per_hour: float | None = None
    steps_file: str | None = None  # a target's measured steps (--target-steps)
    slos: dict[str, float] = field(default_factory=dict)
    request_rate: float | None = None
    memory: int | None = None  # here's memory (default: the OS's)


def fit_text(c: Calibration) -> str:
    d, o = c.decode, c.other
    return (
        f"decode steps at {d.efficiency:.2f} of the roofline + {d.overhead * 1e3:.2f} ms, prefill/mixed steps at "
        f"{o.efficiency:.2f} + {o.overhead * 1e3:.2f} ms"
    )


def run_targets(
    engine: LLMEngine, workload: Workload, cost: StepCost, diagnosis: Diagnosis, opts: TargetOptions, out: Path
) -> list[TargetAnswer]:
    """Every target's answers for `workload`; calibration.json written into `out`."""
    from tokenmill.doctor.diagnose import trace_rate
    from tokenmill.doctor.replays import kv_value_bytes

    print("tokenmill doctor: measuring this machine's roofline and fitting it to the probed steps ...", flush=True)
    worker = engine.core.worker
    here = measure_here(worker.dtype, opts.memory)
    engine_dtype = str(worker.dtype).split(".")[-1]
    own = ModelShape.of(engine.model_config, float(worker.dtype.itemsize), kv_value_bytes(engine))
    local = calibrate_here(cost, own, here, engine_dtype)
    measured = read_measured_steps(opts.steps_file, opts.price_per_hour) if opts.steps_file else None
    cfg = read_model_config(opts.model_config) if opts.model_config else engine.model_config
    totals = [p + o for p, o in zip(diagnosis.prompt_lens, diagnosis.output_lens, strict=True)]
    trace = Trace(
        engine.config,
        workload,
        engine.max_model_len,
        opts.request_rate,
        trace_rate(workload, opts.request_rate),
        opts.slos,
        max(totals),
    )
    answers = []
    for name in opts.targets:
        print(f"tokenmill doctor: replaying the trace on {name}'s roofline ...", flush=True)
        if name == "here":
            here.price_per_hour = opts.price_per_hour
            dtype = opts.weight_dtype if opts.model_config else engine_dtype
            label = f"roofline, calibrated on {local.source} ({fit_text(local)}): within ±{local.band:.0%} of them"
            a = answer(trace, cfg, dtype, here, local, label)
            a.notes.append(
                f"beside it, the doctor's replay on the measured step costs (no roofline): TTFT p50 "
                f"{p50(diagnosis.current, 'ttft'):.1f} ms, TPOT p50 {p50(diagnosis.current, 'tpot'):.2f} ms"
            )
        elif measured is not None and name in (measured.target.name, opts.steps_file):
            c = measured.calibration
            label = f"roofline, calibrated on {c.source} ({fit_text(c)}): within ±{c.band:.0%} of them"
            a = answer(trace, cfg, opts.weight_dtype, measured.target, c, label)
        else:
            target = load_target(name, opts.price_per_hour)
            label = (
                f"roofline, uncalibrated: no steps measured on {target.name}, so no error band; this machine's "
                f"factors carried over ({fit_text(local.carried())}; efficiencies at most 1). They fit this "
                f"machine's own (CPU) steps within ±{local.band:.0%}: that is the CPU's fit, not a bound on "
                f"{target.name}'s error, which no measurement bounds (its kernels reach another share of its "
                "roofline, and this machine's per-step overhead is not its host's); the best case below is the "
                "roofline itself"
            )
            a = answer(trace, cfg, opts.weight_dtype, target, local.carried(), label)
        answers.append(a)
    _store(out, here, local, measured.calibration if measured else None)
    return answers


def _store(out: Path, here: Any, local: Calibration, measured: Calibration | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "here": {
            "bandwidth_gbs": here.bandwidth / 1e9,
            "peak_tflops": here.peak_flops["bfloat16"] / 1e12,
            "memory_gb": here.memory_bytes / 1e9,
            "source": here.source,
        },
        "calibrations": [dataclasses.asdict(c) for c in (local, measured) if c is not None],
    }
    (out / "calibration.json").write_text(json.dumps(record, indent=2) + "\n")


def append_targets(out: Path, answers: list[TargetAnswer]) -> str:
    """report.md gains the Targets section (returned), report.json a "targets" list."""
    lines = [
        "",
        "## Targets (predicted: each step priced by a roofline model; no figure below was measured on the target)",
        "",
    ]
    for a in answers:
        lines += [f"- {line}" for line in a.lines()] + [""]
    text = "\n".join(lines)
    with (out / "report.md").open("a") as f:
        f.write(text)
    path = out / "report.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["targets"] = [
        {
            "target": a.target.name,
            "source": a.target.source,
            "label": a.label,
            "band": a.band,
            "fits": a.fits,
            "fit": a.fit_line,
            "predicted": a.summary and {k: v for k, v in a.summary.items() if k != "errors"},
            "replica_rate": a.replica_rate,
            "replicas": a.replicas,
            "cost_per_million_output_tokens": a.cost_per_million,
        }
        for a in answers
    ]
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return text
