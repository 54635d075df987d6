"""Quantizing at load on one torch thread against two: int8 (per channel) and int4 (groups of 32) of a
5632x2048 bfloat16 matrix (a 1.1B model's gate and up projections), the thread counts interleaved in
each of `--repeats` rounds; the milliseconds per matrix and the 1-minute load average each round ran
under. Writes benchmarks/results/quantize_threads.json (or `--out`).

Usage: python benchmarks/quantize_threads.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from tokenmill.quant.quantize import quantize_int4, quantize_int8

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "quantize_threads.json"))
    args = parser.parse_args()
    w = (torch.randn(5632, 2048, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    quantizers = {"int8": lambda: quantize_int8(w, w.shape[1]), "int4": lambda: quantize_int4(w, 32)}
    runs: dict[str, list[float]] = {}
    loads: list[float] = []
    before = torch.get_num_threads()
    for _ in range(args.repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, fn in quantizers.items():
                fn()
                start = time.perf_counter()
                for _ in range(4):
                    fn()
                runs.setdefault(f"{name} {threads} threads", []).append(round((time.perf_counter() - start) / 4e-3, 1))
        loads.append(round(os.getloadavg()[0], 1))
    torch.set_num_threads(before)
    result = {
        "what": "ms to quantize one 5632x2048 bfloat16 matrix; median of the rounds",
        "cores": os.cpu_count(),
        "median_ms": {k: statistics.median(v) for k, v in runs.items()},
        "runs_ms": runs,
        "load_average_1min": loads,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in result["median_ms"].items():
        print(f"{k:18} {v:8.1f} ms")


if __name__ == "__main__":
    main()
