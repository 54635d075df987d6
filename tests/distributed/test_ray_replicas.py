"""Data-parallel replicas as Ray actors behind the server: the same greedy outputs as one engine, and
a replica killed mid-request — its streamed request gets a 503-class error event, its not yet
answered one starts over on the survivor, the survivor leaks nothing, the replica restarts and
rejoins. On the test run's local Ray cluster (conftest's `ray_cluster`)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tests.server_harness import KV_BLOCK_BYTES, RunningServer, start_server
from tokenmill.distributed.config import ParallelConfig
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def served(tiny_model_dir, ray_cluster):
    # A step a token: the kill tests need a 240-token request still decoding when the later requests
    # arrive and when its replica dies; in runs of 4 the tiny model finishes it in well under a second.
    parallel = ParallelConfig(2, "least_loaded")
    server = start_server(str(tiny_model_dir("llama")), blocks=32, decode_steps=1, parallel=parallel, cpu_threads=2)
    yield server
    server.stop()


def client() -> httpx.Client:
    return httpx.Client(timeout=60, transport=httpx.HTTPTransport(retries=0))


def body(prompt: list[int], max_tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def all_free(served: RunningServer) -> bool:
    stats = served.stats()
    return stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0


def assert_greedy_like_one_engine(served: RunningServer, model_dir: str, prompts: list[list[int]]) -> None:
    """The prompts, sent at once to the server, get one engine's greedy tokens (up to a near tie)."""
    results: dict[int, dict] = {}

    def send(i: int) -> None:
        with client() as c:
            results[i] = c.post(f"{served.base_url}/v1/completions", json=body(prompts[i], 8, logprobs=5)).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ref = LLM(model_dir, max_model_len=256, kv_cache_memory=32 * KV_BLOCK_BYTES, cpu_threads=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    text = served.server.token_text  # the server's token strings: the comparison is in those
    for i, ref_out in enumerate(ref.generate([{"prompt_token_ids": p} for p in prompts], params)):
        got = results[i]["choices"][0]["logprobs"]
        want = ref_out.outputs[0]
        want_top = [{text(t): lp for t, lp in row.items()} for row in top_logprobs(want.logprobs)]
        assert_same_up_to_near_tie(got["tokens"], got["top_logprobs"], [text(t) for t in want.token_ids], want_top)


def test_replicas_give_one_engines_greedy_outputs(served, tiny_model_dir):
    prompts = [[5 + i, 17, 23 + 2 * i, 9, 40 + i] for i in range(4)]
    assert_greedy_like_one_engine(served, str(tiny_model_dir("llama")), prompts)
    wait_until(lambda: all_free(served))
    routed = served.server.engine.metrics.render().decode()
    for replica in ("0", "1"):
        assert f'tokenmill:replica_requests_routed_total{{by="load",model_name="tiny",replica="{replica}"}}' in routed


def test_a_killed_replica_fails_its_stream_moves_its_waiting_request_and_rejoins(served):
    engine = served.server.engine
    base = served.base_url
    events: list[dict] = []
    done: dict[str, httpx.Response] = {}

    def stream() -> None:
        with client() as c, c.stream("POST", f"{base}/v1/completions", json=body([5, 6, 7], 240, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))

    def quiet(name: str, prompt: list[int]) -> None:
        with client() as c:
            done[name] = c.post(f"{base}/v1/completions", json=body(prompt, 200))

    # one after another: streamed -> a replica X, "other" -> the other one, "moved" -> X again (in turn)
    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: len(events) >= 1)  # the stream has had tokens
    (streamed_id,) = list(engine._open)
    x = engine._open[streamed_id].replica
    senders = []
    for name, prompt in (("other", [8, 9]), ("moved", [10, 11, 12])):
        senders.append(threading.Thread(target=quiet, args=(name, prompt)))
        senders[-1].start()
        wait_until(lambda: len(engine._open) == 1 + len(senders))
    placed = {i: e.replica for i, e in engine._open.items()}
    assert sorted(placed.values()) == sorted([x, x, 1 - x])
    victim = engine.clients[x]
    ray.kill(victim.actor, no_restart=True)
    streamer.join(60)
    for s in senders:
        s.join(60)
    assert "error" in events[-1] and events[-1]["error"]["code"] == "replica_lost"
    assert all(done[n].status_code == 200 for n in ("other", "moved"))
    assert all(done[n].json()["usage"]["completion_tokens"] == 200 for n in ("other", "moved"))
    wait_until(lambda: all_free(served))  # the survivor holds nothing
    wait_until(lambda: engine._up == [True, True] and engine.clients[x] is not victim, timeout=120)
    before = routed_to(engine, x)
    with client() as c:  # the rejoined replica takes requests again (idle replicas take turns)
        for i in range(2):
            assert c.post(f"{base}/v1/completions", json=body([20 + i, 21], 4)).status_code == 200
    assert routed_to(engine, x) == before + 1
    assert f'tokenmill:replica_up{{model_name="tiny",replica="{x}"}} 1.0' in engine.metrics.render().decode()
    wait_until(lambda: all_free(served))


def routed_to(engine, replica: int) -> float:
    key = f'tokenmill:replica_requests_routed_total{{by="load",model_name="tiny",replica="{replica}"}} '
    line = next(x for x in engine.metrics.render().decode().splitlines() if x.startswith(key))
    return float(line.removeprefix(key))


@pytest.mark.slow
def test_serve_with_replicas_as_a_process_routes_by_prefix_and_exits_cleanly(tiny_model_dir):
    """`tokenmill serve --data-parallel-size 2 --routing prefix`: the CLI's path, its own local cluster."""
    import os
    import re
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir("llama")), "--port", "0"]
    cmd += ["--max-model-len", "256", "--data-parallel-size", "2", "--routing", "prefix", "--cpu-threads", "2"]
    cmd += ["--served-model-name", "tiny", "--kv-cache-memory", str(64 * KV_BLOCK_BYTES)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        base, deadline = None, time.monotonic() + 120
        while base is None and time.monotonic() < deadline:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
            base = found.group(1) if found else None
        assert base is not None, "no address logged"
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # drain the log
        shared = list(range(5, 5 + 48))  # three 16-token blocks
        with client() as c:
            for i in range(4):
                r = c.post(f"{base}/v1/completions", json=body([*shared, 60 + i], 4, n=2))
                assert r.status_code == 200 and len(r.json()["choices"]) == 2
            metrics = c.get(f"{base}/metrics").text
        by_prefix = sum(
            float(m.group(1))
            for m in re.finditer(r'replica_requests_routed_total\{by="prefix"[^}]*\} ([0-9.]+)', metrics)
        )
        assert by_prefix == 3  # the first by load, the three after it to where their prefix is
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
