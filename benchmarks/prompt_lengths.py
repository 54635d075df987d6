"""A prompt length met for the first time against the same length repeated: why the doctor's probe meets
every length fresh.

SmolLM2-135M-Instruct in bfloat16, one engine: for each of `--lengths` random prompt lengths from
65-512 (seeded), three one-request prompt steps of that length back to back (the whole
`LLMEngine.step`, random tokens so the prefix cache never answers); the figure is the first step's
time over the median of the other two, per length, median and spread over the lengths. Run on an
otherwise idle machine.

Writes benchmarks/results/prompt_lengths.json.

Usage: python benchmarks/prompt_lengths.py [--lengths 40] [--model DIR] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
from pathlib import Path

from common import RESULTS, ROOT

from tokenmill.config import EngineConfig
from tokenmill.doctor.step_cost import Prober
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels.cpu_build import cpu_flags

SMOLLM2 = ROOT.parent / "models" / "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=40)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "prompt_lengths.json"))
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig.from_kwargs(args.model, dtype=args.dtype, enable_prefix_caching=False))
    prober = Prober(engine, seed=0)
    prober.add(32, 2)  # warm-up
    prober.drain()
    rng = random.Random(1)
    rows = []
    for _ in range(args.lengths):
        length = rng.randint(65, 512)
        times = []
        for _ in range(3):
            prober.add(length, 1)
            times.append(prober.drain()[0][0] * 1e3)
        rows.append({"length": length, "ms": times, "first_over_later": times[0] / statistics.median(times[1:])})
        print(f"{length}: {', '.join(f'{t:.1f}' for t in times)} ms", flush=True)
    ratios = [r["first_over_later"] for r in rows]
    quartiles = statistics.quantiles(ratios, n=4)
    summary = {"median": statistics.median(ratios), "p25": quartiles[0], "p75": quartiles[2], "min": min(ratios),
               "max": max(ratios)}  # fmt: skip
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags()},
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "rows": rows,
        "first_over_later": summary,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"first / later: median {summary['median']:.2f}x [p25 {summary['p25']:.2f}, p75 {summary['p75']:.2f}; "
          f"{summary['min']:.2f}-{summary['max']:.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
