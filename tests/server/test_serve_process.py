"""`tokenmill serve` as a real process: it logs its address; on SIGTERM it refuses new work with a
503 while the requests in flight finish, aborts what is left at the drain timeout, and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

# 2 prompts x n=4 sequences of 320 tokens: seconds of decoding for the tiny model, a drain long
# enough to probe the server in (each probe takes milliseconds).
LONG = {"model": "llama", "prompt": ["a", "b"], "n": 4, "max_tokens": 320, "ignore_eos": True}
# outlasts a 0.2 s drain timeout for sure: 16 sequences of 500 tokens (320 x 8 once finished inside 0.5 s)
LONGER = {**LONG, "n": 8, "max_tokens": 500}


@dataclass
class Process:
    proc: subprocess.Popen[str]
    base: str
    log: list[str]


@contextmanager
def serving(model: str, drain_timeout: float) -> Iterator[Process]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", "0", "--max-model-len", "512"]
    cmd += ["--kv-cache-memory", str(600 * 24576), "--drain-timeout", str(drain_timeout)]
    cmd += ["--served-model-name", "llama"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    try:
        base = None
        deadline = time.monotonic() + 60
        assert proc.stderr is not None
        while base is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            log.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            base = found.group(1) if found else None
        assert base is not None, "no address logged"
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            time.sleep(0.05)
        yield Process(proc, base, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def test_sigterm_refuses_new_work_with_503_while_in_flight_requests_finish(tiny_model_dir):
    with serving(str(tiny_model_dir("llama")), drain_timeout=60) as p:
        received: list[str] = []
        with httpx.stream("POST", f"{p.base}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received.append(next(line for line in lines if line.startswith("data:")))
            p.proc.send_signal(signal.SIGTERM)  # mid-stream
            deadline = time.monotonic() + 10
            while httpx.get(f"{p.base}/health", timeout=5).status_code == 200:  # the signal lands
                assert time.monotonic() < deadline, "health still 200 after SIGTERM"
                time.sleep(0.01)
            health = httpx.get(f"{p.base}/health", timeout=5)
            assert health.status_code == 503 and health.headers["retry-after"] == "1"
            body = {"model": "llama", "prompt": "x", "max_tokens": 2}
            refused = httpx.post(f"{p.base}/v1/completions", json=body, timeout=5)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert p.proc.poll() is None  # still draining
            received.extend(line for line in lines if line.startswith("data:"))
        assert received[-1] == "data: [DONE]"
        finished = [c["choices"][0] for c in events(iter(received)) if c["choices"][0]["finish_reason"]]
        # every one of the 8 choices of the in-flight request ran to its end
        assert sorted(c["index"] for c in finished) == list(range(8))
        assert {c["finish_reason"] for c in finished} == {"length"}
        assert p.proc.wait(timeout=30) == 0
    try:  # and it serves nothing more
        httpx.get(f"{p.base}/health", timeout=2)
        raise AssertionError("still serving after SIGTERM")
    except httpx.TransportError:
        pass


def test_the_drain_timeout_aborts_what_is_left_and_exits_zero(tiny_model_dir):
    with serving(str(tiny_model_dir("llama")), drain_timeout=0.2) as p:
        with httpx.stream("POST", f"{p.base}/v1/completions", json={**LONGER, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            p.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        ended = time.monotonic() - signalled
        errors = [e["error"] for e in events(iter(rest)) if "error" in e]
        assert errors and errors[0]["code"] == "shutting_down", rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert ended < 10, f"the stream ended {ended:.1f} s after the signal; the drain timeout is 0.2 s"
        assert p.proc.wait(timeout=30) == 0
        log = "".join(p.log)
        assert "drain timeout: aborting 2 requests still open" in log  # one per prompt
