"""The engine's time outside the model forward with 32 sequences decoding, and the whole step, on
the reference path (`torch` attention and layer ops) and the native one (`cpu` both), with greedy
tokens from full logits, and on the native path with the argmax inside the output projection
(`greedy_head=head`: the argmax then counts as forward), through `tokenmill bench offline
--compare` (interleaved repeats).

The `small` model in float32, prefix caching off, the `random` workload (seed 0): 64 requests of
128 prompt and 128 output tokens (EOS ignored), all at once, at most 32 running. A step counts when
all 32 run and each adds one token; the figures are the medians of those steps in each repeat.
Writes benchmarks/results/step_overhead.json.

Usage: python benchmarks/step_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse

from common import RESULTS, cell, ensure_model
from common import bench as run_bench

VARIANTS = {
    "reference": "attention_backend=torch,layer_ops=torch,greedy_head=logits",
    "native": "attention_backend=cpu,layer_ops=cpu,greedy_head=logits",
    "native, argmax in the head": "attention_backend=cpu,layer_ops=cpu,greedy_head=head",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_model()
    out = RESULTS / "step_overhead.json"
    result = run_bench(
        "offline", str(model), "--dtype", "float32", "--max-num-seqs", "32", "--no-enable-prefix-caching",
        "--workload", "random", "--num-requests", "64", "--input-len", "128", "--output-len", "128", "--seed", "0",
        "--compare", *VARIANTS.values(), "--repeats", str(args.repeats), "--warmup", "2", "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    for name, label in VARIANTS.items():
        a = result.aggregate[label]
        print(
            f"{name:28} full decode step {cell(a['full_decode_step_ms'])} ms, outside the forward "
            f"{cell(a['full_decode_overhead_ms'])} ms, output {cell(a['output_throughput'], '{:.0f}')} tokens/s"
        )


if __name__ == "__main__":
    main()
