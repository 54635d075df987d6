"""A weight-only quantized product at many rows (`--quantization int4 | int8`, bfloat16 activations)
through every kernel this CPU offers for it (quant/int_methods.py), on the 1.1B model's layer shapes
(TinyLlama: qkv 2560x2048, o 2048x2048, gate+up 11264x2048, down 2048x5632), random weights (int4 in
groups of 32, int8 per output channel).

The kernels: `dequant` (the weights dequantized to bfloat16, then torch's bfloat16 GEMM), int4's
`dequant32` (float32 weights and torch's float32 GEMM, the rows widened and the product rounded back),
`widened` / int8's `broadcast` (AVX2: float32 outer-product tiles over weight rows widened in cache;
elsewhere `broadcast` runs `tiled`'s loop), int4's `gemm` (int8 activations in runs of 32, integer sums:
the decode kernel's arithmetic, its loops ordered for many rows), int8's `native` (a weight row
against 8 x rows at a time) and `tiled` (4 weight rows x 4 x rows), and AMX's where granted.

Per row count (16: a batch of decodes; 64: the largest batch class; 128 and 512: prompt chunks), the
kernels interleaved in each of `--repeats` rounds, each the milliseconds of one product per shape
summed over the four shapes; medians, spreads, and each kernel's time over the fastest's. Writes
benchmarks/results/<--out> (default quant_many_rows_<Q>.json).

Usage: python benchmarks/quant_many_rows.py [--quantization int4] [--repeats 3] [--rows 16,64,128,512]
       [--kernels a,b] [--out FILE]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="int4", choices=("int4", "int8"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="16,64,128,512")
    parser.add_argument("--kernels", help="a comma list (default: every kernel offered here)")
    parser.add_argument("--out")
    args = parser.parse_args()
    group = 32 if args.quantization == "int4" else None
    method = get_quant_method(QuantSpec(args.quantization, group), load_cpu_kernels())
    kernels = method.kernels(torch.bfloat16)
    names = args.kernels.split(",") if args.kernels else sorted(kernels)
    weights = [method.quantize(torch.randn(n, k) * 0.02, group or k) for n, k in SHAPES]
    ms: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for rows in (int(r) for r in args.rows.split(",")):
                xs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES]
                for name in names:
                    if name == "native" and args.quantization == "int4" and rows > 8:
                        continue  # (int4's `native` is kept to decode rows: `gemm` is its many-row order)
                    start = time.perf_counter()
                    for w, x in zip(weights, xs, strict=True):
                        kernels[name](w, x, None)
                    ms.setdefault(f"{rows} rows", {}).setdefault(name, []).append(
                        round((time.perf_counter() - start) * 1e3, 1)
                    )
    table = {}
    for key, by in ms.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        best = min(med.values())
        table[key] = {
            "median_ms": med,
            "spread_ms": {name: [min(v), max(v)] for name, v in by.items()},
            "runs_ms": by,
            "over_fastest": {name: round(m / best, 2) for name, m in med.items()},
        }
        print(key + ": " + ", ".join(f"{name} {m:.0f} ms" for name, m in sorted(med.items(), key=lambda kv: kv[1])))
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    result = {
        "what": f"one {args.quantization} product per TinyLlama layer shape, bfloat16 activations, summed ms; "
        "median of the repeats",
        "quantization": args.quantization,
        "simd": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags],
        "cpu": next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line), ""),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "repeats": args.repeats,
        "rows": table,
    }
    (RESULTS / (args.out or f"quant_many_rows_{args.quantization}.json")).write_text(
        json.dumps(result, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
