"""The paged attention kernel of this tree against an earlier commit's, in one process, interleaved.

Both versions of kernels/csrc/attention.cpp (with the headers it includes) are built with the flags
the engine builds with (kernels/cpu_build.py: `-march=native`, or the TOKENMILL_MAX_ISA cap's target),
each as its own library, and `paged_attention` of each is timed on the same inputs, alternating
within every repeat: decode steps (`--decodes`: B sequences of one new token at context N) over
caches of `--layers` layers so that the K/V read each layer comes from memory, as in a decode step,
and prompts (`--prompts`: one sequence's whole prompt as one chunk of N tokens). Head shapes: the
1.1B peer model's (32 query heads, 4 KV heads, head size 64), bfloat16, block size 16, shuffled
block tables. Prints and records microseconds a layer, median [min-max], and before / after per
repeat (above 1: this tree faster).

Writes benchmarks/results/attention_before_after.json (or `--out`, a name there or an absolute path).

Usage: python benchmarks/attention_before_after.py --before REF [--decodes 1x1017,8x192,8x1017,1x4096]
       [--prompts 512,1017] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tokenmill.kernels.cpu_build import compile_flags, cpu_flags, max_isa

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CSRC = "tokenmill/kernels/csrc"
HEADS, KV_HEADS, DIM, BLOCK = 32, 4, 64, 16


def build(name: str, sources: dict[str, str], folder: Path):  # -> the op namespace
    """attention.cpp and its headers built as library `name` (its ops renamed into it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in sources.items():
        (folder / file).write_text(text.replace("tokenmill_cpu", name) if file.endswith(".cpp") else text)
    source = [str(folder / "attention.cpp")]
    flags = list(compile_flags())
    load(
        name,
        source,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return getattr(torch.ops, name)


def sources_at(ref: str | None) -> dict[str, str]:
    """attention.cpp at `ref` (None: this tree) and the local headers it includes."""

    def read(name: str) -> str:
        if ref is None:
            return (ROOT / CSRC / name).read_text()
        show = ["git", "-C", str(ROOT), "show", f"{ref}:{CSRC}/{name}"]
        return subprocess.run(show, capture_output=True, text=True, check=True).stdout

    main = read("attention.cpp")
    headers = re.findall(r'^#include "([^"]+)"', main, flags=re.M)
    return {"attention.cpp": main, **{h: read(h) for h in headers}}


def case(batch: int, ctx: int, query: int, layers: int):
    """Inputs for B sequences of `query` new tokens at context `ctx`, one cache per layer; returns a
    callable timing `ops.paged_attention` over every layer, in microseconds a layer."""
    blocks = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(batch * 100_003 + ctx)
    caches = [
        tuple(torch.randn(batch * blocks, KV_HEADS, BLOCK * DIM, generator=gen).bfloat16() for _ in range(2))
        for _ in range(layers)
    ]
    tables = torch.randperm(batch * blocks, generator=gen).to(torch.int32).view(batch, blocks)
    q = torch.randn(batch * query, HEADS, DIM, generator=gen).bfloat16()
    out = torch.empty_like(q)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    starts = torch.arange(batch, dtype=torch.int32) * query
    qlens = torch.full((batch,), query, dtype=torch.int32)

    def run(ops) -> float:
        begin = time.perf_counter()
        for k, v in caches:
            ops.paged_attention(out, q, k, v, None, None, tables, lens, starts, qlens, BLOCK, DIM**-0.5, None)
        return (time.perf_counter() - begin) * 1e6 / layers

    return run


def compare(sides: dict, kind: str, batch: int, ctx: int, query: int, layers: int, repeats: int) -> dict:
    """One case timed on both sides, alternating (the order flipped every repeat); its record row."""
    run = case(batch, ctx, query, layers)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for ops in sides.values():  # warm, unmeasured
        run(ops)
    for r in range(repeats):
        order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
        for side, ops in order:
            times[side].append(run(ops))
    ratios = [b / a for b, a in zip(times["before"], times["after"], strict=True)]
    spread = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    med = {side: statistics.median(t) for side, t in times.items()}
    print(
        f"{kind} B={batch} ctx={ctx}: before {med['before']:.1f} us/layer, after {med['after']:.1f}"
        f"  ({spread['median']:.2f}x [{spread['min']:.2f}-{spread['max']:.2f}])",
        flush=True,
    )
    return {"kind": kind, "batch": batch, "context": ctx, "query": query, "us_per_layer": times,
            "before_over_after": spread}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose kernel is compared with this tree's")
    ap.add_argument("--decodes", default="1x1017,8x192,8x1017,1x4096", help="BxCTX decode steps")
    ap.add_argument("--prompts", default="512,1017", help="prompt lengths, one chunk each")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="attention_before_after.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    suffix = (max_isa() or "native").replace("-", "_")
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            "before": build(f"tm_attn_before_{suffix}", sources_at(args.before), Path(tmp) / "before"),
            "after": build(f"tm_attn_after_{suffix}", sources_at(None), Path(tmp) / "after"),
        }
        cases = [("decode", *map(int, d.split("x")), 1, args.layers) for d in args.decodes.split(",") if d]
        cases += [("prompt", 1, int(n), int(n), 2) for n in args.prompts.split(",") if n]
        rows = [compare(sides, *c, args.repeats) for c in cases]
    out = Path(args.out) if os.path.isabs(args.out) else RESULTS / args.out
    record = {"benchmark": "attention_before_after", "before": args.before, "threads": args.threads,
              "repeats": args.repeats, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK},
              "isa_cap": max_isa(), "cpu_flags": cpu_flags(capped=False), "rows": rows}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
