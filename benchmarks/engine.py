"""Engine benchmark: continuous vs static batching vs transformers `generate`, offline, in one run,
through `tokenmill bench offline`.

Workload `mixed` (seed 0): 200 requests, prompt and output lengths log-normal (medians 128 and 64
tokens, clipped to 32–512 and 8–512), EOS ignored, greedy, all submitted at once. Variants,
interleaved in each of 3 repeats, same max batch size (32) and dtype: tokenmill with static
batching (a batch admitted whole with KV reserved for prompt + max_tokens), tokenmill with
continuous batching, and transformers `generate` on left-padded batches of 32 in arrival order
(`--baseline hf`). Writes benchmarks/results/engine_<dtype>.json and latency plots beside it, and
prints the figures benchmarks/RESULTS.md quotes: output tokens/s and the gains, mean end-to-end latency, the share of
allocated KV slots holding live tokens, and the step time outside the forward with 32 decoding.

`--model DIR` runs another model folder (results: engine_<folder name>_<dtype>.json).

Usage: python benchmarks/engine.py [--dtype float32] [--repeats 3] [--requests 200] [--model DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS, cell, ensure_model, plot
from common import bench as run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model folder (default: the small peer model, built once)")
    args = parser.parse_args()
    model = Path(args.model) if args.model else ensure_model()
    stem = f"engine_{model.name}_{args.dtype}" if args.model else f"engine_{args.dtype}"
    out = RESULTS / f"{stem}.json"
    result = run_bench(
        "offline", str(model), "--workload", "mixed", "--num-requests", str(args.requests),
        "--input-len", "32:512", "--output-len", "8:512", "--seed", "0",
        "--compare", "scheduling=static", "scheduling=continuous", "--baseline", "hf",
        "--repeats", str(args.repeats), "--dtype", args.dtype, "--threads", str(args.threads),
        "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--max-model-len", "1024",
        "--out", str(out),
    )  # fmt: skip
    plot(out, RESULTS / stem)
    a, g = result.aggregate, result.gains
    cont, static, hf = a["scheduling=continuous"], a["scheduling=static"], a["hf"]
    over_static = g["scheduling=continuous over scheduling=static"]["output_throughput"]
    over_hf = g["scheduling=continuous over hf"]["output_throughput"]
    print(f"\nRESULTS.md figures ({args.dtype}):")
    for name, side in (("continuous", cont), ("static", static), ("transformers", hf)):
        e2e_s = {k: v / 1e3 for k, v in side["e2e.mean"].items() if k != "samples"}
        print(
            f"  {name}: output tokens/s {cell(side['output_throughput'], '{:.0f}')}, mean e2e s {cell(e2e_s, '{:.1f}')}"
        )
    print(f"  continuous / static tokens/s: {cell(over_static)}x")
    print(f"  continuous / transformers tokens/s: {cell(over_hf)}x")
    live, static_live = cont["kv_live_share"]["median"], static["kv_live_share"]["median"]
    print(f"  KV live share: continuous {live:.1%}, static {static_live:.1%}")
    if "full_decode_overhead_ms" in cont:
        over, step = cont["full_decode_overhead_ms"], cont["full_decode_step_ms"]
        share = over["median"] / step["median"]
        print(f"  outside the forward, 32 decoding: {cell(over)} ms of {step['median']:.1f} ms ({share:.1%})")


if __name__ == "__main__":
    main()
