"""A GGUF file kept quantized against the same file dequantized: SmolLM2-135M-Instruct's Q4_1 GGUF
(`make serve` fetches it) through `tokenmill bench offline --compare quantization=auto
quantization=none`, both in bfloat16 (`auto`: its 210 Q4_1 matrices as int4 groups of 32, its tied
Q8_0 table as an int8 output projection; `none`: every weight dequantized to bfloat16), interleaved
in each of 3 repeats; `random` workload, 128-token prompts, 128 new tokens (EOS ignored), greedy, at
1 concurrent request (4 requests) and 8 (16). Reports output tokens/s, TPOT and the ratio, and the
weight bytes each holds (`llm.stats()`); writes benchmarks/results/gguf_kept.json.

Usage: python benchmarks/gguf_kept.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json

from common import RESULTS, ROOT, cell
from common import bench as run_bench

GGUF = ROOT.parent / "models" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONCURRENCY = {1: 4, 8: 16}  # concurrency -> requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not GGUF.is_file():
        raise SystemExit(f"{GGUF} is not set up (make serve fetches it)")
    rows = {}
    for conc, requests in CONCURRENCY.items():
        out = RESULTS / "gguf_kept" / f"c{conc}.json"  # the raw runs (not in git)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = run_bench(
            "offline", str(GGUF), "--workload", "random", "--num-requests", str(requests), "--input-len", "128",
            "--output-len", "128", "--max-concurrency", str(conc), "--seed", "0", "--dtype", "bfloat16",
            "--max-num-seqs", "32", "--compare", "quantization=none", "quantization=auto",
            "--repeats", str(args.repeats), "--no-progress", "--out", str(out),
        )  # fmt: skip
        a = result.aggregate
        rows[f"c{conc}"] = {
            q: {
                "output_tok_per_s": a[f"quantization={q}"]["output_throughput"],
                "tpot_ms": a[f"quantization={q}"]["tpot.median"],
            }
            for q in ("auto", "none")
        } | {"auto_over_none": result.gains["quantization=auto over quantization=none"]["output_throughput"]}
        r = rows[f"c{conc}"]
        print(
            f"c={conc}: auto {cell(r['auto']['output_tok_per_s'], '{:.0f}')} tok/s, none "
            f"{cell(r['none']['output_tok_per_s'], '{:.0f}')} tok/s, auto over none {cell(r['auto_over_none'])}x"
        )
    from tokenmill import LLM

    weight_bytes = {q: LLM(str(GGUF), dtype="bfloat16", quantization=q).stats().weight_bytes for q in ("auto", "none")}
    print(f"weights: {', '.join(f'{q} {b / 2**20:.1f} MiB' for q, b in weight_bytes.items())}")
    result = {"model": GGUF.name, "dtype": "bfloat16", "weight_bytes": weight_bytes, "rows": rows}
    (RESULTS / "gguf_kept.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
