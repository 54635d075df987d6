"""The peers table from the project: tokenmill beside llama.cpp, vLLM's CPU build and transformers,
one engine at a time on the same weights, through `../shared/peers/bench.sh`.

The workload is the peers' (shared/PEERS.md): the 16 prompts of 128 tokens of `$PEERS_DIR/prompts.json`,
new greedy tokens with EOS ignored, output tokens/s at each concurrency (median of the repeats, each
level after an unmeasured pass), and each server's start-up time (seconds until it answered).
`--model mid-llama` runs the 1.1B model (setup.sh `WITH_MID=1`) and its GGUF files.

Like with like: both engines serve every repeat without a prompt cache. tokenmill runs with prefix
caching off (`--no-enable-prefix-caching`) and llama.cpp's slot prompt cache is turned off per request
(`LOAD_EXTRA={"cache_prompt": false}`), since the load repeats its prompts. `--prefill` measures the
prompt rate instead: 8 prompts joined into one of 1,024 tokens, one at a time, one new token.

Pairs (the ratios): each tokenmill row against the llama.cpp row of the same precision or file:
float32 vs f32, bfloat16 vs f16, int8 vs q8_0, int4 vs q4_0, and a GGUF file served by tokenmill
(`tokenmill_gguf_TYPE`) against llama.cpp serving that same file (`cpp_TYPE`): the fairest pair.
On the 55M model float32 and bfloat16 are also compared with vLLM and transformers.

This script needs the peers built first (`PEERS_DIR=DIR bash ../shared/peers/setup.sh`, slow: it
builds them); it runs bench.sh, reads its raw results, and writes one JSON with every row, the
machine's CPU flags and the ratios.

Usage: python benchmarks/peers.py --peers-dir DIR [--model mid-llama] [--engines "..."] [--prefill] [--out FILE]
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

from tokenmill.kernels.cpu_build import cpu_flags, isa_cap_settings, max_isa

SHARED = ROOT.parent.parent / "shared" / "peers"
DEFAULT_ENGINES = "hf_fp32 hf_bf16 cpp_f32 cpp_f16 cpp_q8_0 vllm_bf16 vllm_fp32 tokenmill_fp32 tokenmill_bf16"
SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx512_fp16")
# each tokenmill row against the peers of its precision: llama.cpp's GGUF of that width, vLLM, transformers
PEERS_OF = {
    "tokenmill_fp32": ("cpp_f32", "vllm_fp32", "hf_fp32"),
    "tokenmill_bf16": ("cpp_f16", "vllm_bf16", "hf_bf16"),
    "tokenmill_int8": ("cpp_q8_0",),
    "tokenmill_w8a8": ("cpp_q8_0",),
    "tokenmill_int4": ("cpp_q4_0",),
}
MID_ENGINES = (
    "cpp_f16 cpp_q8_0 cpp_q4_0 cpp_q4_k_m tokenmill_bf16 tokenmill_int8 tokenmill_int4 "
    "tokenmill_gguf_f16 tokenmill_gguf_q8_0 tokenmill_gguf_q4_0 tokenmill_gguf_q4_k_m"
)
NO_PROMPT_CACHE = '{"cache_prompt": false}'  # llama.cpp's slot cache off: tokenmill runs without one too
PREFILL_ENV = {"PROMPT_JOIN": "8", "MAX_TOKENS": "1", "CONCS": "1", "MAX_NUM_SEQS": "4", "CPP_ARGS": "-c 8192"}


def peers_of(row: str) -> tuple[str, ...]:
    """The rows a tokenmill row is compared with: the same file for a GGUF row, else PEERS_OF."""
    if row.startswith("tokenmill_gguf_"):
        return ("cpp_" + row.removeprefix("tokenmill_gguf_"),)
    return PEERS_OF.get(row, ())


def medians(row: dict[str, Any], metric: str) -> dict[int, dict[str, float]]:
    """Per concurrency: median, min and max of `metric` (out_tok_per_s, prompt_tok_per_s) over the repeats."""
    by_conc: dict[int, list[float]] = {}
    for r in row["results"]:
        by_conc.setdefault(int(r["concurrency"]), []).append(float(r[metric]))
    return {c: {"median": statistics.median(v), "min": min(v), "max": max(v)} for c, v in sorted(by_conc.items())}


def read_rows(results: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        rows[r["engine"]] = r  # the last try of a row counts, as in bench.sh's table
    return rows


def run_bench(args: argparse.Namespace, peers: Path) -> Path:
    """Run bench.sh with this run's settings; the path of the results it wrote."""
    env = {**os.environ, "PEERS_DIR": str(peers), "ENGINES": args.engines, "TM_ARGS": args.tm_args}
    env["MODEL"] = args.model
    env.setdefault("LOAD_EOS", "ignore_eos")
    env.setdefault("LOAD_EXTRA", NO_PROMPT_CACHE)
    if args.prefill:
        env.update({k: v for k, v in PREFILL_ENV.items() if k not in os.environ})
    elif args.model != "tiny-llama":
        env.setdefault("CONCS", "1 8")
        env.setdefault("MAX_TOKENS", "64")
    cli = Path(sys.executable).with_name("tokenmill")
    before = set((peers / "bench-results").glob("*")) if (peers / "bench-results").exists() else set()
    subprocess.run(["bash", str(SHARED / "bench.sh"), str(cli)], env=env, check=False)
    runs = sorted(set((peers / "bench-results").glob("*")) - before)
    if not runs:
        raise SystemExit("bench.sh wrote no results")
    return runs[-1] / "results.jsonl"


def ratios_of(table: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each tokenmill row's median over each of its peers' (peers_of), per concurrency."""
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for ours, stats in table.items():
        peers = [p for p in peers_of(ours) if p in table]
        if not ours.startswith("tokenmill_") or not peers:
            continue
        ratios[ours] = {
            f"c{c}": {f"vs_{p}": s["median"] / table[p][c]["median"] for p in peers if c in table[p]}
            for c, s in stats.items()
        }
    return ratios


def print_table(table: dict[str, dict[int, dict[str, float]]], rows: dict[str, dict[str, Any]]) -> None:
    concs = sorted({c for t in table.values() for c in t})
    print(f"\n{'engine':24}" + "".join(f"{'c=' + str(c):>18}" for c in concs) + f"{'ready s':>9}")
    for name, t in table.items():
        cells = "".join(
            f"{t[c]['median']:>8.1f} [{t[c]['min']:.0f}-{t[c]['max']:.0f}]" if c in t else f"{'-':>18}" for c in concs
        )
        ready = rows[name].get("ready_s")
        print(f"{name:24}{cells}{ready if ready is not None else '-':>9}")


def isa_cap(peers: Path) -> dict[str, object]:
    """Under TOKENMILL_MAX_ISA (docs/native-kernels.md): the caps the run had, the CPU's own SIMD flags,
    and the llama.cpp build the rows ran (bench.sh takes PEERS_DIR/llamacpp-build/bin)."""
    if not max_isa():
        return {}
    own = set(cpu_flags(capped=False).split())
    return {
        "isa_cap": isa_cap_settings(),
        "simd_uncapped": [f for f in SIMD if f in own],
        "llama_bin": str((peers / "llamacpp-build" / "bin").resolve()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR"), required="PEERS_DIR" not in os.environ)
    parser.add_argument("--model", default="tiny-llama", help="tiny-llama (55M) or mid-llama (1.1B, WITH_MID=1)")
    parser.add_argument("--engines", help=f"bench.sh rows (default: the 55M set, or for mid-llama {MID_ENGINES})")
    parser.add_argument("--tm-args", default="--no-enable-prefix-caching")
    parser.add_argument("--prefill", action="store_true", help="the prompt rate: one 1,024-token prompt at a time")
    parser.add_argument("--results", help="read an earlier bench.sh run's results.jsonl instead of running one")
    parser.add_argument("--out", help="JSON path (default: results/peers[_MODEL][_prefill].json)")
    args = parser.parse_args()
    args.engines = args.engines or (DEFAULT_ENGINES if args.model == "tiny-llama" else MID_ENGINES)
    peers = Path(args.peers_dir).resolve()
    results = Path(args.results) if args.results else run_bench(args, peers)
    rows = read_rows(results)
    metric = "prompt_tok_per_s" if args.prefill else "out_tok_per_s"
    table = {name: medians(row, metric) for name, row in rows.items() if row["results"]}
    ratios = ratios_of(table)
    flags = set(cpu_flags().split())
    name = "peers" + ("" if args.model == "tiny-llama" else f"_{args.model}") + ("_prefill" if args.prefill else "")
    out_path = Path(args.out) if args.out else RESULTS / f"{name}.json"
    out = {
        "model": args.model,
        "metric": metric,
        "workload": "prefill: 8 prompts joined (1,024 tokens), 1 new token, c=1"
        if args.prefill
        else "16 prompts x 128 tokens, new tokens with EOS ignored, greedy; median of the repeats (bench.sh)",
        "prompt_cache": "off for both (tokenmill --no-enable-prefix-caching, llama.cpp cache_prompt false)",
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "simd": [f for f in SIMD if f in flags],
        **isa_cap(peers),
        "tm_args": args.tm_args,
        "results_file": str(results),
        "rows": {
            n: {metric: table[n], "ready_s": rows[n].get("ready_s"), "noisy": rows[n]["noisy"], "rc": rows[n]["rc"]}
            for n in table
        },
        "ratios": ratios,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print_table(table, rows)
    for ours, entry in ratios.items():
        for c, vs in entry.items():
            print(f"{ours} {c}: " + ", ".join(f"{r:.2f}x {k.removeprefix('vs_')}" for k, r in vs.items()))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
