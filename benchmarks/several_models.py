"""Load and unload times of a several-model server (`tokenmill serve --models`), and the memory an
unload gives back.

One `tokenmill serve --models FILE` process serves the bundled demo model and the 1.1B model
(/tmp/peers/mid-llama, bfloat16, random weights; its KV cache 256 MiB). Each repeat, for each model
in turn (interleaved): an explicit load (`POST /v1/models/NAME/load`: the child process spawned, the
weights read, the warm-up, the front end built), a one-token completion, an unload (`POST .../unload`:
the child asked to stop and gone), then a cold request (a one-token completion sent while the model
is unloaded: load + answer) and an unload again. Wall times as the client sees them, the server's own
`load_seconds` / `unload_seconds`, and the server's process tree's RSS loaded and after the unload.
Prints median [min-max] of the repeats; writes benchmarks/results/several_models.json.

Usage: nice python benchmarks/several_models.py [--repeats 3] [--mid /tmp/peers/mid-llama]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import RESULTS
from serve import free_port

from tokenmill.bench.metrics import spread

DEMO = Path(__file__).resolve().parent.parent / "models" / "tokenmill-demo"


def tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total


def start(models_file: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--models", str(models_file), "--port", str(port)]
    cmd += ["--load-wait", "600", "--log-interval", "600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def one_token(base: str, name: str) -> float:
    started = time.perf_counter()
    body = {"model": name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - started


def post(base: str, path: str) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    r = httpx.post(f"{base}{path}", timeout=900)
    r.raise_for_status()
    return time.perf_counter() - started, r.json()


def repeat(base: str, pid: int, name: str) -> dict[str, float]:
    idle = tree_rss(pid)
    load, card = post(base, f"/v1/models/{name}/load")
    server_load = card["load_seconds"]
    warm = one_token(base, name)
    loaded = tree_rss(pid)
    unload, card = post(base, f"/v1/models/{name}/unload")
    server_unload = card["unload_seconds"]
    after = tree_rss(pid)
    cold = one_token(base, name)
    post(base, f"/v1/models/{name}/unload")
    return {
        "load_s": load, "server_load_s": server_load, "warm_request_s": warm, "unload_s": unload,
        "server_unload_s": server_unload, "cold_request_s": cold,
        "rss_idle_mib": idle / 2**20, "rss_loaded_mib": loaded / 2**20, "rss_after_unload_mib": after / 2**20,
        "rss_returned_mib": (loaded - after) / 2**20,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mid", default="/tmp/peers/mid-llama")
    parser.add_argument("--out", default=str(RESULTS / "several_models.json"))
    args = parser.parse_args()
    models = {
        "demo": {"path": str(DEMO), "kv_cache_memory": "64MiB"},
        "mid-llama": {"path": args.mid, "kv_cache_memory": "256MiB", "dtype": "bfloat16"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        models_file = Path(tmp) / "models.json"
        models_file.write_text(json.dumps(models))
        port = free_port()
        server = start(models_file, port)
        base = f"http://127.0.0.1:{port}"
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
        try:
            for i in range(args.repeats):
                for name in models:
                    runs[name].append(repeat(base, server.pid, name))
                    print(f"repeat {i} {name}: {json.dumps(runs[name][-1])}", flush=True)
            weights = {c["id"]: c["memory_bytes"] for c in httpx.get(f"{base}/v1/models").json()["data"]}
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    summary = {name: {k: spread([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    for name, stats in summary.items():
        line = ", ".join(f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for k, v in stats.items())
        print(f"{name}: {line}")
    result = {
        "what": "load / unload times and RSS returned, tokenmill serve --models (demo model; 1.1B mid-llama bf16)",
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "models": models,
        "memory_estimates_bytes": weights,
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
