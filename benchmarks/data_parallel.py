"""Data-parallel replicas on Ray: prefix-aware routing against least-loaded, and one engine, on a
shared-prefix workload, with the same total KV memory and the same threads on every side.

Three servers, each started fresh (an empty prefix cache) for each run, the runs interleaved in each
of 3 repeats: one engine (`--kv-cache-memory M`, 2 threads); two replicas on a local Ray cluster
(`--data-parallel-size 2`, M/2 of KV memory and 1 thread each) with `--routing prefix`; the same two
with `--routing least_loaded`. The workload (`tokenmill bench serve --workload shared-prefix`, seed 0):
8 groups of requests, each group sharing a 512-token system prompt, a distinct 32-token question per
request, 16 output tokens, 96 requests, at most 8 in flight, streamed. M holds about 1.5x the 8
system prompts: one engine keeps them all while 8 requests run; least-loaded routing sends every
group to both replicas, each of which then has half the room for all of them. The prefix hit rate
is the servers' own count (`tokenmill:prefix_cache_hits` / `queries` from /metrics, summed over the
replicas), output tokens/s and TTFT from the client. Writes benchmarks/results/data_parallel.json.

Usage: python benchmarks/data_parallel.py [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import tempfile
from pathlib import Path

import httpx
from common import RESULTS, ensure_model, kv_token_bytes
from common import bench as run_bench
from serve import free_port, start_server

GROUPS, PREFIX, QUESTION, OUTPUT, REQUESTS, CONCURRENCY = 8, 512, 32, 16, 96, 8
WORKLOAD = {"groups": GROUPS, "prefix_len": PREFIX, "question_len": QUESTION, "output_len": OUTPUT}
WORKLOAD |= {"requests": REQUESTS, "max_concurrency": CONCURRENCY, "seed": 0}
VARIANTS = {
    "one engine": ("1", "least_loaded"),
    "2 replicas, prefix routing": ("2", "prefix"),
    "2 replicas, least-loaded": ("2", "least_loaded"),
}


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for name in ("prefix_cache_hits", "prefix_cache_queries"):
        found = re.search(rf"^tokenmill:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    return out


def one_run(model: Path, label: str, dtype: str, kv_bytes: int, repeat: int, runs_dir: Path) -> dict[str, float]:
    replicas, routing = VARIANTS[label]
    port = free_port()
    server = start_server(
        model, port, "--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", "16",
        "--kv-cache-memory", str(kv_bytes // int(replicas)), "--cpu-threads", "2",
        "--data-parallel-size", replicas, "--routing", routing, "--log-interval", "600",
    )  # fmt: skip
    out = runs_dir / f"{label.replace(' ', '_').replace(',', '')}_{repeat}.json"  # the client's records
    try:
        result = run_bench(
            "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", model.name, "--tokenizer", str(model),
            "--workload", "shared-prefix", "--num-groups", str(GROUPS), "--prefix-len", str(PREFIX),
            "--input-len", str(QUESTION), "--output-len", str(OUTPUT), "--num-requests", str(REQUESTS),
            "--max-concurrency", str(CONCURRENCY), "--seed", "0", "--no-progress", "--out", str(out),
        )  # fmt: skip
        cache = scrape(port)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    summary = result.runs[0].summary
    return {
        "hit_rate": cache["prefix_cache_hits"] / max(cache["prefix_cache_queries"], 1.0),
        "output_throughput": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft"]["median"],  # (the summary's latencies are in ms)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model = ensure_model()
    kv_bytes = int(1.5 * GROUPS * PREFIX * kv_token_bytes(model, args.dtype))
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in VARIANTS}
    with tempfile.TemporaryDirectory() as runs_dir:
        for repeat in range(args.repeats):
            for label in VARIANTS:
                runs[label].append(one_run(model, label, args.dtype, kv_bytes, repeat, Path(runs_dir)))
                print(f"[{repeat}] {label}: {runs[label][-1]}", flush=True)
    aggregate = {
        label: {
            key: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
            for key in rs[0]
            for v in [[r[key] for r in rs]]
        }
        for label, rs in runs.items()
    }
    result = {
        "model": "make-model --arch llama --size small --seed 0",
        "dtype": args.dtype,
        "kv_cache_memory_total": kv_bytes,
        "workload": WORKLOAD,
        "repeats": args.repeats,
        "runs": runs,
        "aggregate": aggregate,
    }
    path = RESULTS / "data_parallel.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}\n| server | prefix hit rate | output tokens/s | TTFT p50, ms |")
    for label, a in aggregate.items():
        h, t, f = a["hit_rate"], a["output_throughput"], a["ttft_p50_ms"]
        print(
            f"| {label} | {h['median']:.1%} [{h['min']:.1%}–{h['max']:.1%}] | {t['median']:.0f} [{t['min']:.0f}–"
            f"{t['max']:.0f}] | {f['median']:.0f} [{f['min']:.0f}–{f['max']:.0f}] |"
        )


if __name__ == "__main__":
    main()
