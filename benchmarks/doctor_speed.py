"""The doctor's own speed on a long trace: reading a 10,000-request window and replaying it.

A window of `--requests` requests of a trace read as `tokenmill doctor --workload KIND:FILE` reads it
(doctor/traces/: windowed, lengths fitted to the model's context), then replayed through the simulator
at the current settings (`diagnose.Replays`, fast-forward on), the cost model probed on the model's
engine first (the probe's and the calibration's progress lines printed as the doctor prints them).
With `--diagnose`, also every replay the doctor's six questions run (`diagnose.diagnose`, without the
measured quantization and stall checks, which run the model and do not grow with the trace). With
`--report`, the whole report as `tokenmill doctor --workload KIND:FILE` makes it: the six questions
with those checks, and report.md / report.json / the charts written (`report_seconds`), and the
user's wait from the trace read to the report (`whole_report_seconds`: read, probe, calibration,
report); the replays it ran and how many a capacity search stopped early are counted.

The trace: `--trace KIND:FILE` (e.g. Azure's whole `AzureLLMInferenceTrace_conv.csv`, Mooncake's
`conversation_trace.jsonl`), else one written for the run: `--requests` rows in Azure's format whose
lengths are drawn from benchmarks/data/azure_conv_window.csv's rows and whose arrivals are Poisson at
that window's rate. Figures: seconds for each phase (one run each: a shared machine's noise is small
against the minute the issue asks for). Writes benchmarks/results/doctor_speed.json (`--out`: a name
there, or an absolute path).

With `--targets here,h100 --slo tpot:MS [--repeats N]`, also the report's Targets section (`run_targets`,
each target's capacity search), N times interleaved with the search as it was before the cap at the
ceiling (`capacity_p99` without `cap`, patched in for the run): seconds and replays of each, median and
spread, and whether both gave the same answers (they must).

Usage: python benchmarks/doctor_speed.py [--trace KIND:FILE] [--requests 10000] [--diagnose] [--report]
    [--targets here,h100 --slo tpot:50 --repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import statistics
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT

from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.config import EngineConfig
from tokenmill.doctor import target_report as report_module
from tokenmill.doctor import targets as targets_module
from tokenmill.doctor.calibrate import calibrate
from tokenmill.doctor.diagnose import Diagnosis, Replays, diagnose, write_report
from tokenmill.doctor.hardware import measure_here
from tokenmill.doctor.step_cost import StepCost, probe
from tokenmill.doctor.target_report import TargetOptions, run_targets
from tokenmill.doctor.traces.load import TraceFlags, load_workload
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine_args import DEMO_MODEL

WINDOW = ROOT / "data" / "azure_conv_window.csv"


def write_azure_like(path: Path, requests: int, seed: int = 0) -> None:
    """`requests` rows in Azure's CSV format: lengths drawn from WINDOW's rows, Poisson arrivals at its rate."""
    with WINDOW.open(newline="") as f:
        rows = list(csv.DictReader(f))
    times = [datetime.fromisoformat(r["TIMESTAMP"]) for r in rows]
    rate = (len(rows) - 1) / (times[-1] - times[0]).total_seconds()
    rng = random.Random(seed)
    t = times[0]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for _ in range(requests):
            row = rng.choice(rows)
            out.writerow([t.isoformat(sep=" "), row["ContextTokens"], row["GeneratedTokens"]])
            t += timedelta(seconds=rng.expovariate(rate))


def say(text: str) -> None:
    print(f"doctor_speed: {text}", flush=True)


def time_targets(
    engine: LLMEngine, workload: Any, cost: StepCost, diagnosis: Diagnosis, opts: TargetOptions, repeats: int
) -> dict[str, Any]:
    """The Targets section `repeats` times, each run beside one with the capacity search uncapped (as before
    the cap at the ceiling): seconds and replays of each, and the answers compared."""
    capped = targets_module.capacity_p99
    here = measure_here(engine.core.worker.dtype, opts.memory)  # (once: a new measurement a run moves `here`)
    report_module.measure_here = lambda dtype, memory: here

    def uncapped(at_rate: Any, slos: dict[str, float], start: float, cap: float = 0.0) -> float:
        return capped(at_rate, slos, start)

    seconds: dict[str, list[float]] = {"before": [], "after": []}
    searched: dict[str, int] = {}
    answers: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(repeats):
            for variant in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                targets_module.capacity_p99 = uncapped if variant == "before" else capped
                calls = []
                inner = targets_module.capacity_p99

                def counted(at_rate: Any, *rest: Any, _inner: Any = inner, _calls: list = calls, **kw: Any) -> float:
                    return _inner(lambda r: _calls.append(r) or at_rate(r), *rest, **kw)

                targets_module.capacity_p99 = counted
                start = time.perf_counter()
                got = run_targets(engine, workload, cost, diagnosis, opts, Path(out))
                seconds[variant].append(time.perf_counter() - start)
                targets_module.capacity_p99 = capped
                searched[variant] = len(calls)
                answers[variant] = [(a.fits, a.replica_rate, a.replicas, a.summary and a.summary["tpot"]) for a in got]
                say(
                    f"targets {variant} (repeat {repeat + 1}): {seconds[variant][-1]:.1f} s, "
                    f"{len(calls)} search replays"
                )
    return {
        variant: {
            "median_seconds": statistics.median(v),
            "min_seconds": min(v),
            "max_seconds": max(v),
            "seconds": v,
            "capacity_search_replays": searched[variant],
        }
        for variant, v in seconds.items()
    } | {"same_answers": answers["before"] == answers["after"]}


def time_report(engine: LLMEngine, workload: Any, cost: StepCost, slos: dict[str, float], info: Any) -> dict[str, Any]:
    """The whole report as `tokenmill doctor --workload KIND:FILE --slo ...` makes it once the costs are
    measured: `diagnose` with its measured checks, then `write_report`; its seconds and replays."""
    said: list[str] = []

    def counted(text: str) -> None:
        said.append(text)
        say(text)

    start = time.perf_counter()
    found = diagnose(engine, workload, cost, slos=slos, trace_info=info, progress=counted)
    with tempfile.TemporaryDirectory() as out:
        write_report(found, Path(out))
    seconds = time.perf_counter() - start
    replays = [line for line in said if line.startswith("replay ")]
    say(f"the whole report: {seconds:.1f} s, {len(replays)} replays")
    return {
        "report_seconds": seconds,
        "report_replays": len(replays),
        "report_replays_stopped_early": sum("stopped after" in line for line in replays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="KIND:FILE (default: an Azure-like trace written for the run)")
    parser.add_argument("--window", default=None, help="START:END seconds of the trace")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--diagnose", action="store_true", help="also every replay the six questions run")
    parser.add_argument("--report", action="store_true", help="also the whole report, as tokenmill doctor makes it")
    parser.add_argument("--targets", default=None, help="e.g. here,h100: also the Targets section, timed")
    parser.add_argument("--slo", default="tpot:50", help="with --targets: ttft:MS,tpot:MS")
    parser.add_argument("--repeats", type=int, default=3, help="with --targets: interleaved runs of each")
    parser.add_argument("--out", default="doctor_speed.json")  # a name under benchmarks/results, or an absolute path
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, max_num_seqs=args.max_num_seqs, dtype="bfloat16"))
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            written = Path(tmp) / "azure_like.csv"
            write_azure_like(written, args.requests)
            trace = f"azure:{written}"
        vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
        start = time.perf_counter()
        workload, info = load_workload(
            WorkloadSpec(trace, args.requests), engine.tokenizer, engine.max_model_len, vocab,
            TraceFlags(args.window, 1.0, "fit"),
        )  # fmt: skip
        read_s = time.perf_counter() - start
    say(f"read and shaped {len(workload.requests)} requests in {read_s:.1f} s")
    start = time.perf_counter()
    probed = probe(engine, progress=say)
    cost = calibrate(engine, workload, probed, None, progress=say)
    calibration_s = time.perf_counter() - start - probed.probe_seconds
    start = time.perf_counter()
    replays = Replays.of(engine, cost, workload, None, progress=say)
    summary = replays({})
    replay_s = time.perf_counter() - start
    sim = replays.engine({}).record
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "model": Path(args.model).name,
        "trace": trace if args.trace else f"azure-like, {args.requests} rows drawn from {WINDOW.name}",
        "requests": len(workload.requests),
        "trace_notes": info.notes if info else [],
        "read_seconds": read_s,
        "replay_seconds": replay_s,
        "read_and_replay_seconds": read_s + replay_s,
        "simulated_steps": sim.steps,
        "simulated_seconds": summary["duration_s"],
        "probe_seconds": cost.probe_seconds,
        "calibration_seconds": calibration_s,
    }
    say(f"one replay: {replay_s:.1f} s ({sim.steps} steps, {summary['duration_s']:.0f} s of trace time)")
    slos = {k: float(v) for k, v in (part.split(":") for part in args.slo.split(","))}
    if args.report:
        result |= time_report(engine, workload, cost, slos, info)
        result["whole_report_seconds"] = read_s + cost.probe_seconds + calibration_s + result["report_seconds"]
    if args.diagnose or args.targets:
        start = time.perf_counter()
        found = diagnose(
            engine, workload, cost, slos=slos, measure_quantization=False, measure_stalls=False, progress=say
        )
        result["diagnose_replays_seconds"] = time.perf_counter() - start
        say(f"the six questions' replays: {result['diagnose_replays_seconds']:.1f} s")
        if args.targets:
            opts = TargetOptions(args.targets.split(","), price_per_hour=2.0, slos=slos)
            result["targets"] = {"slos": slos, **time_targets(engine, workload, cost, found, opts, args.repeats)}
    (RESULTS / args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
