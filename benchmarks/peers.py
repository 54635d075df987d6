"""The peers table from the project: tokenmill beside llama.cpp, vLLM's CPU build and transformers,
one engine at a time on the same weights, through `../shared/peers/bench.sh`.

The workload is the peers' (shared/PEERS.md): the 16 prompts of 128 tokens of `$PEERS_DIR/prompts.json`,
128 new greedy tokens each with EOS ignored, output tokens/s at concurrency 1, 4 and 16 (median of 3
repeats, each after an unmeasured pass). tokenmill runs `tokenmill serve` with prefix caching off
(`TM_ARGS=--no-enable-prefix-caching`: the load repeats 16 prompts, which the peers do not cache).
This script needs the peers built first (`PEERS_DIR=DIR bash ../shared/peers/setup.sh`, slow: it builds them);
it runs bench.sh, reads its raw results, and writes one JSON with every row, the machine's CPU flags,
and tokenmill's ratios at each concurrency to the peers of its precision (float32: llama.cpp f32,
vLLM fp32, transformers fp32; bfloat16: llama.cpp f16, vLLM bf16, transformers bf16), or, when the
tokenmill arguments quantize (`--tm-args "--no-enable-prefix-caching --quantization int8
--quantization-group-size 32"`), to llama.cpp's q8_0 GGUF of the same weights.

Usage: python benchmarks/peers.py --peers-dir DIR [--engines "cpp_f32 cpp_f16 ..."] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT

from tokenmill.kernels.cpu_build import cpu_flags

SHARED = ROOT.parent.parent / "shared" / "peers"
DEFAULT_ENGINES = "hf_fp32 hf_bf16 cpp_f32 cpp_f16 cpp_q8_0 vllm_bf16 vllm_fp32 tokenmill_fp32 tokenmill_bf16"
SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx512_fp16")
# each tokenmill row against the peers of its precision: llama.cpp's GGUF of that width, vLLM, transformers
PEERS_OF = {
    "tokenmill_fp32": ("cpp_f32", "vllm_fp32", "hf_fp32"),
    "tokenmill_bf16": ("cpp_f16", "vllm_bf16", "hf_bf16"),
}
# a quantized tokenmill (`--tm-args "... --quantization int8 --quantization-group-size 32"`: llama.cpp's
# Q8_0 grid, one scale per 32 weights) against llama.cpp's q8_0 GGUF of the same weights
QUANTIZED_PEERS_OF = {"tokenmill_fp32": ("cpp_q8_0",), "tokenmill_bf16": ("cpp_q8_0",)}


def medians(row: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per concurrency: median, min and max output tokens/s of the row's repeats."""
    by_conc: dict[int, list[float]] = {}
    for r in row["results"]:
        by_conc.setdefault(int(r["concurrency"]), []).append(float(r["out_tok_per_s"]))
    return {c: {"median": statistics.median(v), "min": min(v), "max": max(v)} for c, v in sorted(by_conc.items())}


def read_rows(results: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        rows[r["engine"]] = r  # the last try of a row counts, as in bench.sh's table
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR"), required="PEERS_DIR" not in os.environ)
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--tm-args", default="--no-enable-prefix-caching")
    parser.add_argument("--results", help="read an earlier bench.sh run's results.jsonl instead of running one")
    parser.add_argument("--out", default=str(RESULTS / "peers.json"))
    args = parser.parse_args()
    peers = Path(args.peers_dir).resolve()
    if args.results:
        results = Path(args.results)
    else:
        env = {**os.environ, "PEERS_DIR": str(peers), "ENGINES": args.engines, "TM_ARGS": args.tm_args}
        env.setdefault("LOAD_EOS", "ignore_eos")
        cli = Path(sys.executable).with_name("tokenmill")
        before = set((peers / "bench-results").glob("*")) if (peers / "bench-results").exists() else set()
        subprocess.run(["bash", str(SHARED / "bench.sh"), str(cli)], env=env, check=False)
        runs = sorted(set((peers / "bench-results").glob("*")) - before)
        if not runs:
            raise SystemExit("bench.sh wrote no results")
        results = runs[-1] / "results.jsonl"
    rows = read_rows(results)
    table = {name: medians(row) for name, row in rows.items()}
    flags = set(cpu_flags().split())
    ratios: dict[str, dict[str, Any]] = {}
    quantized = "--quantization" in args.tm_args
    for ours, peers_of in (QUANTIZED_PEERS_OF if quantized else PEERS_OF).items():
        if ours not in table:
            continue
        ratios[ours] = {
            f"c{c}": {
                f"vs_{peer}": stats["median"] / table[peer][c]["median"]
                for peer in peers_of
                if peer in table and c in table[peer]
            }
            for c, stats in table[ours].items()
        }
    out = {
        "workload": "16 prompts x 128 tokens, 128 new tokens (EOS ignored), greedy; out tok/s at c=1/4/16, "
        "median of 3 repeats (bench.sh)",
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "simd": [f for f in SIMD if f in flags],
        "tm_args": args.tm_args,
        "results_file": str(results),
        "rows": {n: {"out_tok_per_s": table[n], "noisy": rows[n]["noisy"], "rc": rows[n]["rc"]} for n in rows},
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{'engine':16}" + "".join(f"{'c=' + str(c):>18}" for c in (1, 4, 16)))
    for name, t in table.items():
        cells = "".join(f"{t[c]['median']:>8.1f} [{t[c]['min']:.0f}-{t[c]['max']:.0f}]" for c in t)
        print(f"{name:16}{cells}")
    for ours, entry in ratios.items():
        for c, vs in entry.items():
            print(f"{ours} {c}: " + ", ".join(f"{r:.2f}x {k.removeprefix('vs_')}" for k, r in vs.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
