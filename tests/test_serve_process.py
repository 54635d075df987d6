"""`tokenmill serve` as a real process: it logs its address, drains on SIGTERM and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx


def test_sigterm_drains_in_flight_requests_and_exits_zero(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        str(tiny_model_dir("llama")),
        "--port",
        "0",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        str(64 * 24576),
        "--drain-timeout",
        "20",
        "--served-model-name",
        "llama",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = None
        deadline = time.monotonic() + 60
        assert proc.stderr is not None
        while base is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            base = found.group(1) if found else None
        assert base is not None, "no address logged"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            time.sleep(0.05)

        body = {"model": "llama", "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}
        received: list[str] = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received.append(next(line for line in lines if line.startswith("data:")))
            proc.send_signal(signal.SIGTERM)  # mid-stream
            received.extend(line for line in lines if line.startswith("data:"))
        assert received[-1] == "data: [DONE]"
        last = json.loads(received[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"  # the in-flight request ran to its end
        assert proc.wait(timeout=30) == 0
        try:  # and it takes no new work
            httpx.get(f"{base}/health", timeout=2)
            raise AssertionError("still serving after SIGTERM")
        except httpx.TransportError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
