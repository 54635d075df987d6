"""A prompt's attention in the `cpu` backend, one layer's worth, through each `prompt_attention` path:
`native` (the paged kernel, attention.cpp) and `sdpa` (torch's flash kernel over the gathered keys).

For each prompt length, the prompt is cut into the engine's chunks (`--chunk`, its
max_num_batched_tokens) and each chunk runs `CpuPagedBackend.forward` as a prefill step does: the
chunk's K/V written into a paged cache (shuffled block table), then its queries attended over every
key so far. The head shapes are a model's (`--heads`, `--kv-heads`, `--head-dim`; default the 1.1B
peer model's 32 / 4 / 64). The paths alternate within each repeat; each figure is the median
milliseconds for the whole prompt [min-max] and the per-repeat ratio, with the causal GFLOP/s (the
two products over the keys each query sees). Threads: torch's (`--threads`). The CPU's flags and
any ISA cap (TOKENMILL_MAX_ISA) are recorded.

Writes benchmarks/results/prompt_attention.json (or `--out`, a name there or an absolute path).

Usage: python benchmarks/prompt_attention.py [--lengths 128,512,1017,4096] [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from tokenmill.kernels.cpu_build import cpu_flags, max_isa, require_cpu_kernels
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends.cpu_paged import PROMPT_ATTENTION, CpuPagedBackend

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16


def prompt_ms(
    backend: CpuPagedBackend, length: int, chunk: int, shape: tuple[int, int, int], dtype: torch.dtype
) -> float:
    """Milliseconds for one prompt of `length` tokens, chunk by chunk, through `backend`."""
    heads, kv_heads, dim = shape
    blocks = -(-length // BLOCK_SIZE)
    table = list(range(blocks))
    random.Random(length).shuffle(table)
    cache = allocate_kv_cache(backend, 1, blocks, BLOCK_SIZE, kv_heads, dim, dtype)[0]
    gen = torch.Generator().manual_seed(length)
    total = 0.0
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        q = torch.randn(n, heads, dim, generator=gen).to(dtype)
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        md = backend.build_metadata([n], [start + n], [table], BLOCK_SIZE)
        begin = time.perf_counter()
        backend.forward(q, k, v, cache, md, dim**-0.5, None)
        total += time.perf_counter() - begin
    return total * 1e3


def causal_flops(length: int, shape: tuple[int, int, int]) -> float:
    heads, _, dim = shape
    return 2 * 2 * heads * dim * length * (length + 1) / 2  # QK^T and PV over the keys each query sees


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1017,4096")
    ap.add_argument("--chunk", type=int, default=512, help="prompt chunk (the engine's max_num_batched_tokens)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="prompt_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = require_cpu_kernels("attention_backend")
    backends = {name: CpuPagedBackend(kernels, name) for name in PROMPT_ATTENTION}
    shape = (args.heads, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:  # warm both paths (and torch's kernels) once, unmeasured
        for backend in backends.values():
            prompt_ms(backend, min(length, args.chunk + 1), args.chunk, shape, dtype)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in backends}
    for _ in range(args.repeats):
        for length in lengths:
            for name, backend in backends.items():
                times[name][length].append(prompt_ms(backend, length, args.chunk, shape, dtype))
    rows = []
    for length in lengths:
        row: dict[str, object] = {"length": length}
        for name in backends:
            ms = times[name][length]
            row[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "repeats_ms": ms}
            row[f"{name}_gflops"] = causal_flops(length, shape) / statistics.median(ms) / 1e6
        ratios = [s / n for s, n in zip(times["sdpa"][length], times["native"][length], strict=True)]
        row["sdpa_over_native"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
        print(
            f"{length:6d} tokens: native {row['native']['median_ms']:8.2f} ms ({row['native_gflops']:.0f} GFLOP/s)"  # type: ignore[index]
            f"  sdpa {row['sdpa']['median_ms']:8.2f} ms ({row['sdpa_gflops']:.0f} GFLOP/s)"  # type: ignore[index]
            f"  sdpa / native {row['sdpa_over_native']['median']:.2f}x",  # type: ignore[index]
            flush=True,
        )
    out = Path(args.out) if os.path.isabs(args.out) else RESULTS / args.out
    record = {
        "benchmark": "prompt_attention",
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "dtype": args.dtype,
        "chunk": args.chunk,
        "block_size": BLOCK_SIZE,
        "threads": args.threads,
        "repeats": args.repeats,
        "isa_cap": max_isa(),
        "cpu_flags": cpu_flags(capped=False),
        "torch": torch.__version__,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
