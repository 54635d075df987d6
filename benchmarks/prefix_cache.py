"""Prefix-caching benchmark: TTFT with caching off and on, requests sharing a long system prompt,
through `tokenmill bench offline`.

Workload `shared-prefix` (seed 0): 65 requests sharing one 1,024-token system prompt, each adding a
distinct 64-token question and asking for 4 tokens, sent one at a time (`--max-concurrency 1`), the
`small` model, same dtype on both sides, both variants interleaved in each of 3 repeats, each run
starting from an empty cache (its first request fills it). Prints TTFT p50 per variant, the gain,
and cached tokens against the theoretical maximum (every full 16-token block of the shared prompt,
for every request after the first). Writes benchmarks/results/prefix_cache_<dtype>.json.

Usage: python benchmarks/prefix_cache.py [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse

from common import RESULTS, cell, ensure_model
from common import bench as run_bench

PREFIX, QUESTION, REQUESTS, BLOCK = 1024, 64, 65, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    result = run_bench(
        "offline", str(ensure_model()), "--workload", "shared-prefix", "--num-groups", "1",
        "--prefix-len", str(PREFIX), "--input-len", str(QUESTION), "--output-len", "4",
        "--num-requests", str(REQUESTS), "--max-concurrency", "1", "--seed", "0",
        "--compare", "enable_prefix_caching=false", "enable_prefix_caching=true",
        "--repeats", str(args.repeats), "--dtype", args.dtype, "--threads", str(args.threads),
        "--max-model-len", "2048", "--kv-cache-memory", str(512 * 1024**2),
        "--out", str(RESULTS / f"prefix_cache_{args.dtype}.json"),
    )  # fmt: skip
    on, off = result.aggregate["enable_prefix_caching=true"], result.aggregate["enable_prefix_caching=false"]
    gain = result.gains["enable_prefix_caching=true over enable_prefix_caching=false"]["ttft.median"]
    theoretical = (REQUESTS - 1) * (PREFIX // BLOCK) * BLOCK
    cached = [r.summary["cached_tokens"] for r in result.runs if r.label == "enable_prefix_caching=true"]
    print(f"\nRESULTS.md figures ({args.dtype}):")
    print(f"  TTFT p50 ms: on {cell(on['ttft.median'], '{:.1f}')}, off {cell(off['ttft.median'], '{:.0f}')}")
    print(f"  off / on: {cell(gain)}x")
    print(f"  cached tokens / theoretical maximum: {min(cached) / theoretical:.1%} (least of {len(cached)} runs)")


if __name__ == "__main__":
    main()
