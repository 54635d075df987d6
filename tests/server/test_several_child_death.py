"""`serve --models`: a model's child process killed (SIGKILL) while a streamed request runs on it. The client
gets an error event in OpenAI's shape and the end of the stream (no hang), the server stays up, the model
is unloaded and loads again on the next request in a new process, and nothing is left held or running."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil

from tests.several_harness import start_several, write_models_file


def test_a_child_killed_mid_stream_ends_the_stream_cleanly_and_the_model_reloads(tiny_model_dir, tmp_path) -> None:
    # a long answer (500 tokens: hundreds of steps), so the kill lands while it is generated
    alpha = {"path": str(tiny_model_dir("llama")), "max_model_len": 512}
    running = start_several(write_models_file(tmp_path, {"alpha": alpha}))
    try:
        body = {"model": "alpha", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
        events: list[str] = []
        started = time.monotonic()
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events.append(next(lines))  # (the first token is out: the request is running in the child)
            pid = running.pid("alpha")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            events += list(lines)  # (ends: the read timeout would fail the test on a hang)
        assert time.monotonic() - started < 30
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] in ("service_unavailable", "internal_error") and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        tokens = sum(len(json.loads(e.removeprefix("data: "))["choices"][0]["text"]) > 0 for e in events[:-2])
        assert 1 <= tokens < 500  # (cut short: not a whole answer)

        assert httpx.get(f"{running.base_url}/health", timeout=5).status_code == 200  # the server stays up
        entry = running.pool.entries["alpha"]
        assert running.wait_for(lambda: entry.state == "unloaded", 30), entry.state
        card = httpx.get(f"{running.base_url}/v1/models/alpha", timeout=5).json()
        assert card["state"] == "unloaded"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

        again = {**body, "stream": False, "max_tokens": 8}
        r = httpx.post(f"{running.base_url}/v1/completions", json=again, timeout=120)
        assert r.status_code == 200, r.text
        assert running.pid("alpha") not in (None, pid)  # loaded again, in a new process
        running.assert_no_leaks()
        assert entry.users == 0 and entry.waiters == 0
    finally:
        running.stop()
