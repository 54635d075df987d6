"""Serving benchmark: a tokenmill server under a concurrency sweep, through `tokenmill bench serve`.

Starts `tokenmill serve` on the `small` model (bfloat16, at most 32 sequences, loopback, a free port)
in a subprocess, then runs the `mixed` workload (seed 0; 48 requests, prompts 32–512 and outputs
8–256 tokens, log-normal, EOS ignored, streamed) at max-concurrency 1, 2, 4, 8, 16 and 32, the sweep
points interleaved in each of 3 repeats. Prefix caching is off on the server: every run sends the
same prompts, and a server keeps its cache between runs, so later runs would find them cached.
Writes benchmarks/results/serve_sweep.json and the plots in benchmarks/results/serve_sweep/
(throughput against TPOT and TTFT, latency CDFs), and prints its table in benchmarks/RESULTS.md.

Usage: python benchmarks/serve.py [--repeats 3] [--requests 48]
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import RESULTS, cell, ensure_model, plot
from common import bench as run_bench

POINTS = "1,2,4,8,16,32"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    """`tokenmill serve MODEL --port PORT FLAGS...` on loopback; returns once /health answers."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the tokenmill server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    model = ensure_model()
    port = free_port()
    server = start_server(
        model, port, "--dtype", "bfloat16", "--max-num-seqs", "32", "--max-model-len", "1024",
        "--max-waiting", "256", "--log-interval", "600",
        "--no-enable-prefix-caching",  # every run sends the same prompts: no run may find them cached
    )  # fmt: skip
    out = RESULTS / "serve_sweep.json"
    try:
        result = run_bench(
            "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", model.name, "--tokenizer", str(model),
            "--workload", "mixed", "--num-requests", str(args.requests), "--input-len", "32:512",
            "--output-len", "8:256", "--seed", "0", "--sweep", f"max-concurrency={POINTS}",
            "--repeats", str(args.repeats), "--goodput", "ttft:1000,tpot:100", "--out", str(out),
        )  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    plot(out, RESULTS / "serve_sweep")
    print(
        "\nRESULTS.md table: "
        "| max concurrency | output tokens/s | TTFT p50, ms | TPOT p50, ms | ITL p99, ms | goodput |"
    )
    for c in POINTS.split(","):
        a = result.aggregate[f"max-concurrency={c}"]
        good = a["goodput_share"]["median"]
        print(
            f"| {c} | {cell(a['output_throughput'], '{:.0f}')} | {cell(a['ttft.median'], '{:.0f}')} | "
            f"{cell(a['tpot.median'], '{:.1f}')} | {cell(a['itl.p99'], '{:.1f}')} | {good:.0%} |"
        )


if __name__ == "__main__":
    main()
