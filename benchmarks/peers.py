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

Interleaved repeats: `--passes N` (default 3) runs bench.sh N times with one repeat each (REPEATS=1
unless given), the engines' order reversed every other pass (A B, B A, A B), so a drift in the
machine's speed over the run lands on both sides of a pair. Each row's figure is the median over the
passes [min-max]; each pair's ratio is the median of its per-pass ratios [min-max]. Before each pass
`bandwidth.py` measures the machine's read bandwidth (`--no-bandwidth` skips it), so the figure a
decode rate is compared with comes from the same run; it varies between processes on some virtual
machines, so every pass's figure is kept.

This script needs the peers built first (`PEERS_DIR=DIR bash ../shared/peers/setup.sh`, slow: it
builds them); it runs bench.sh, reads its raw results, and writes one JSON with every row, the
machine's CPU flags, the bandwidth figures and the ratios.

Usage: python benchmarks/peers.py --peers-dir DIR [--model mid-llama] [--engines "..."] [--prefill]
       [--passes 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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


def read_rows(results: list[Path]) -> list[dict[str, dict[str, Any]]]:
    """Each pass's rows by engine (a row's last try counts, as in bench.sh's table)."""
    passes = []
    for path in results:
        rows: dict[str, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows[r["engine"]] = r
        passes.append(rows)
    return passes


def merge_passes(passes: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One row an engine: its results from every pass, its ready times, noisy if any pass was."""
    merged: dict[str, dict[str, Any]] = {}
    for rows in passes:
        for name, r in rows.items():
            row = merged.setdefault(name, {"results": [], "ready_s": [], "noisy": False, "rc": []})
            row["results"] += r["results"]
            row["ready_s"].append(r.get("ready_s"))
            row["noisy"] = row["noisy"] or bool(r["noisy"])
            row["rc"].append(r["rc"])
    return merged


def run_bench(args: argparse.Namespace, peers: Path, engines: str) -> Path:
    """Run bench.sh with this run's settings over `engines`; the path of the results it wrote."""
    env = {**os.environ, "PEERS_DIR": str(peers), "ENGINES": engines, "TM_ARGS": args.tm_args}
    env["MODEL"] = args.model
    env.setdefault("LOAD_EOS", "ignore_eos")
    env.setdefault("LOAD_EXTRA", NO_PROMPT_CACHE)
    if args.passes > 1:
        env.setdefault("REPEATS", "1")  # the passes are the repeats
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


def bandwidth_gb_s() -> float:
    """The machine's read bandwidth now (bandwidth.py in its own process, as each engine runs in its)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bandwidth.json"
        script = Path(__file__).with_name("bandwidth.py")
        subprocess.run([sys.executable, str(script), "--repeats", "5", "--out", str(out)], check=True)
        return float(json.loads(out.read_text())["read_gb_s"])


def run_passes(args: argparse.Namespace, peers: Path) -> tuple[list[Path], list[float]]:
    """`args.passes` bench.sh runs, the engines' order reversed every other one; their results files and
    the bandwidth measured before each."""
    engines = args.engines.split()
    results, bandwidth = [], []
    for i in range(args.passes):
        if args.bandwidth:
            bandwidth.append(bandwidth_gb_s())
        order = engines if i % 2 == 0 else engines[::-1]
        print(f"[peers] pass {i + 1} of {args.passes}: {' '.join(order)}", flush=True)
        results.append(run_bench(args, peers, " ".join(order)))
    return results, bandwidth


def ratios_of(passes: list[dict[str, dict[int, dict[str, float]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each tokenmill row over each of its peers (peers_of), per concurrency: the median of the per-pass
    ratios [min-max] (a pass's figure is its median when bench.sh ran several repeats)."""
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    names = {n for table in passes for n in table}
    for ours in sorted(names):
        peers = [p for p in peers_of(ours) if p in names]
        if not ours.startswith("tokenmill_") or not peers:
            continue
        entry: dict[str, dict[str, Any]] = {}
        for p in peers:
            for c in sorted({c for t in passes for c in t.get(ours, {})}):
                each = [
                    t[ours][c]["median"] / t[p][c]["median"]
                    for t in passes
                    if c in t.get(ours, {}) and c in t.get(p, {})
                ]
                if each:
                    stats = {"median": statistics.median(each), "min": min(each), "max": max(each), "passes": each}
                    entry.setdefault(f"c{c}", {})[f"vs_{p}"] = stats
        ratios[ours] = entry
    return ratios


def print_table(table: dict[str, dict[int, dict[str, float]]], rows: dict[str, dict[str, Any]]) -> None:
    concs = sorted({c for t in table.values() for c in t})
    print(f"\n{'engine':24}" + "".join(f"{'c=' + str(c):>18}" for c in concs) + f"{'ready s':>9}")
    for name, t in table.items():
        cells = "".join(
            f"{t[c]['median']:>8.1f} [{t[c]['min']:.0f}-{t[c]['max']:.0f}]" if c in t else f"{'-':>18}" for c in concs
        )
        ready = [r for r in rows[name]["ready_s"] if r is not None]
        print(f"{name:24}{cells}{statistics.median(ready) if ready else '-':>9}")


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
    parser.add_argument("--passes", type=int, default=3, help="interleaved bench.sh runs (the repeats)")
    parser.add_argument("--no-bandwidth", dest="bandwidth", action="store_false", help="skip bandwidth.py")
    parser.add_argument("--results", nargs="+", help="read earlier bench.sh runs' results.jsonl instead (a pass each)")
    parser.add_argument("--out", help="JSON path (default: results/peers[_MODEL][_prefill].json)")
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes: expected a positive integer, got {args.passes}")
    args.engines = args.engines or (DEFAULT_ENGINES if args.model == "tiny-llama" else MID_ENGINES)
    peers = Path(args.peers_dir).resolve()
    if args.results:
        results, bandwidth = [Path(r) for r in args.results], []
    else:
        results, bandwidth = run_passes(args, peers)
    passes = read_rows(results)
    rows = merge_passes(passes)
    metric = "prompt_tok_per_s" if args.prefill else "out_tok_per_s"
    table = {name: medians(row, metric) for name, row in rows.items() if row["results"]}
    ratios = ratios_of([{n: medians(r, metric) for n, r in p.items() if r["results"]} for p in passes])
    flags = set(cpu_flags().split())
    name = "peers" + ("" if args.model == "tiny-llama" else f"_{args.model}") + ("_prefill" if args.prefill else "")
    out_path = Path(args.out) if args.out else RESULTS / f"{name}.json"
    out = {
        "model": args.model,
        "metric": metric,
        "workload": "prefill: 8 prompts joined (1,024 tokens), 1 new token, c=1"
        if args.prefill
        else "16 prompts x 128 tokens, new tokens with EOS ignored, greedy; median of the repeats (bench.sh)",
        "passes": len(results),
        "repeats": "interleaved passes, the engines' order reversed every other one"
        if len(results) > 1
        else "bench.sh's",
        "bandwidth_gb_s": bandwidth,
        "prompt_cache": "off for both (tokenmill --no-enable-prefix-caching, llama.cpp cache_prompt false)",
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "simd": [f for f in SIMD if f in flags],
        **isa_cap(peers),
        "tm_args": args.tm_args,
        "results_files": [str(r) for r in results],
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
            print(
                f"{ours} {c}: "
                + ", ".join(
                    f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] {k.removeprefix('vs_')}" for k, r in vs.items()
                )
            )
    if bandwidth:
        print("read bandwidth before each pass, GB/s: " + ", ".join(f"{b:.1f}" for b in bandwidth))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
