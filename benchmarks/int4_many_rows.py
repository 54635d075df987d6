"""int4's many-row product with bfloat16 activations: `dequant` (the weights dequantized to bfloat16,
then torch's bfloat16 GEMM) against `dequant32` (float32 weights and torch's float32 GEMM, the rows
widened and the product rounded back), `widened` where built (AVX2: float32 outer-product tiles over
weight rows dequantized in cache) and `gemm` (int8 activations in runs of 32, integer sums: the decode
kernel's arithmetic, its loops ordered for many rows), quant/int_methods.py, on the 1.1B model's layer
shapes (TinyLlama: qkv 2560x2048, o 2048x2048, gate+up 11264x2048, down 2048x5632), random weights in groups of 32.

Per row count (16: a batch of decodes; 64: the largest batch class; 128 and 512: prompt chunks), the
kernels interleaved in each of `--repeats` rounds, each the milliseconds of one product per shape
summed over the four shapes; medians, spreads and the ratio. Writes benchmarks/results/int4_many_rows.json.

Usage: python benchmarks/int4_many_rows.py [--repeats 3] [--out int4_many_rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS

from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.quant.config import QuantSpec
from tokenmill.quant.int_methods import get_quant_method

SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))  # (out, in)
ROWS = (16, 64, 128, 512)
KERNELS = ("dequant", "dequant32", "widened", "gemm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="int4_many_rows.json")
    args = parser.parse_args()
    method = get_quant_method(QuantSpec("int4", 32), load_cpu_kernels())
    kernels = method.kernels(torch.bfloat16)
    names = [name for name in KERNELS if name in kernels]
    weights = [method.quantize(torch.randn(n, k) * 0.02, 32) for n, k in SHAPES]
    ms: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for rows in ROWS:
                xs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES]
                for name in names:
                    start = time.perf_counter()
                    for w, x in zip(weights, xs, strict=True):
                        kernels[name](w, x, None)
                    ms.setdefault(f"{rows} rows", {}).setdefault(name, []).append(
                        round((time.perf_counter() - start) * 1e3, 1)
                    )
    table = {}
    for key, by in ms.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        spread = {name: [min(v), max(v)] for name, v in by.items()}
        ratios = {f"dequant32_over_{name}": round(med["dequant32"] / med[name], 2) for name in med}
        table[key] = {"median_ms": med, "spread_ms": spread, "runs_ms": by, **ratios}
        print(key + ": " + ", ".join(f"{name} {m:.0f} ms" for name, m in med.items()) + f"  {ratios}")
    cpuinfo = Path("/proc/cpuinfo").read_text()
    result = {
        "what": "one int4 product per TinyLlama layer shape, bfloat16 activations, summed ms; median of the repeats",
        "avx512_bf16": "avx512_bf16" in cpuinfo,
        "avx512f": "avx512f" in cpuinfo,
        "cpu": next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line), ""),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "repeats": args.repeats,
        "rows": table,
    }
    (RESULTS / args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
