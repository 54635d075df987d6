"""The doctor's simulator against measured runs: predicted vs measured TTFT p50, TPOT p50 and output tokens/s.

SmolLM2-135M-Instruct in bfloat16 (the README's real model), the `mixed` workload (log-normal input and
output lengths: 64 requests, input 32-1024, output 8-256 tokens, Poisson arrivals), three settings:
continuous batching with 16 sequences, continuous batching with 4, and static batching with 16. The
step-cost curve is probed once (`doctor/step_cost.py`) on an engine of the largest setting; each setting
then runs for real (`bench.offline.run_offline`, an in-process engine) and through the simulator
(`doctor/simulator.py`: the real scheduler and KV manager, the probed costs instead of the model), the
measured runs repeated (median of the repeats, spread shown) and interleaved across settings.

Writes benchmarks/results/doctor_sim.json and prints the README's table.

Usage: python benchmarks/doctor_sim.py [--repeats 3] [--rate 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT

from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.workloads import WorkloadSpec, build_workload
from tokenmill.config import EngineConfig
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.step_cost import probe
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--out", default=str(RESULTS / "doctor_sim.json"))
    args = parser.parse_args()

    base = {"model": args.model, "dtype": "bfloat16", "enable_prefix_caching": False, "seed": 0}
    engines = {name: LLMEngine(EngineConfig.from_kwargs(**base, **s)) for name, s in SETTINGS.items()}
    spec = WorkloadSpec("mixed", args.requests, seed=0, input_len=(32, 1024), output_len=(8, 256))
    first = next(iter(engines.values()))
    workload = build_workload(spec, first.tokenizer)
    cost = probe(first)
    print(f"probe: {cost.probe_seconds:.1f} s; per request {cost.per_request * 1e3:.3f} ms, decode attention "
          f"{cost.per_decode_key * 1e9:.1f} ns a key, prompt attention "
          f"{cost.per_prompt_pair * 1e9:.2f} ns a pair")  # fmt: skip

    measured: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            run = run_offline(engine, workload, name, repeat, request_rate=args.rate)
            measured[name].append(figures(summarize(run.records, run.duration_s)))
            print(f"measured {name} #{repeat}: {measured[name][-1]}")
    rows: dict[str, Any] = {}
    for name, engine in engines.items():
        sim = SimulatedEngine(engine.config, engine.core.num_blocks, engine.max_model_len, cost)
        run = run_offline(sim, workload, name, request_rate=args.rate, clock=sim.clock, sleep=sim.sleep)
        predicted = figures(summarize(run.records, run.duration_s))
        runs = measured[name]
        med = {m: statistics.median(r[m] for r in runs) for m in METRICS}
        rows[name] = {
            "settings": SETTINGS[name],
            "measured": med,
            "measured_range": {m: [min(r[m] for r in runs), max(r[m] for r in runs)] for m in METRICS},
            "predicted": predicted,
            "error": {m: predicted[m] / med[m] - 1 for m in METRICS},
            "simulated_steps": sim.record.steps,
        }
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags()},
        "model": Path(args.model).name,
        "workload": workload.describe(),
        "request_rate": args.rate,
        "repeats": args.repeats,
        "step_cost": {
            "prompt_tokens": cost.prompt_tokens,
            "prompt_ms": [s * 1e3 for s in cost.prompt_seconds],
            "decode_batch": cost.decode_batch,
            "decode_ms": [s * 1e3 for s in cost.decode_seconds],
            "per_request_ms": cost.per_request * 1e3,
            "per_decode_key_ns": cost.per_decode_key * 1e9,
            "per_prompt_pair_ns": cost.per_prompt_pair * 1e9,
            "per_mixed_key_ns": cost.per_mixed_key * 1e9,
            "probe_seconds": cost.probe_seconds,
        },
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| setting | TTFT p50 measured / predicted | TPOT p50 | output tokens/s |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        cells = [f"{r['measured'][m]:.1f} / {r['predicted'][m]:.1f} ({r['error'][m] * 100:+.0f}%)" for m in METRICS]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
