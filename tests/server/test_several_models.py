"""`tokenmill serve --models`: several models on one server, each in a child process, loaded on demand.

Routing is checked against each model's own offline output (greedy), so a request answered by the
wrong model fails; loads and unloads against the pool's states and the children's processes; memory
against the process tree's RSS. Every test ends with no lease held and every loaded model's KV
blocks free."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.several_harness import RunningPool, start_several, tiny_base, write_models_file
from tokenmill import LLM, SamplingParams
from tokenmill.server.model_catalog import read_models_file

PROMPT = "The quick brown fox"
KEY = "several-secret"


def complete(base: str, model: str, timeout: float = 120.0, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def offline(folder: Path) -> str:
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=64 * 24576)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text


@pytest.fixture(scope="module")
def folders(tiny_model_dir) -> dict[str, Path]:
    return {"alpha": tiny_model_dir("llama"), "beta": tiny_model_dir("qwen3"), "gamma": tiny_model_dir("mistral")}


@pytest.fixture(scope="module")
def two(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPool]:
    spec = {"alpha": str(folders["alpha"]), "beta": {"path": str(folders["beta"]), "max_n": 2}}
    running = start_several(write_models_file(tmp_path_factory.mktemp("two"), spec))
    yield running
    running.stop()


def test_requests_go_to_the_model_they_name(two: RunningPool, folders: dict[str, Path]) -> None:
    cards = httpx.get(f"{two.base_url}/v1/models").json()["data"]
    assert [(c["id"], c["state"]) for c in cards] == [("alpha", "unloaded"), ("beta", "unloaded")]
    for name in ("alpha", "beta", "alpha"):
        r = complete(two.base_url, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        assert r.json()["choices"][0]["text"] == offline(folders[name]), name
    chat = httpx.post(
        f"{two.base_url}/v1/chat/completions",
        json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "beta"
    too_many = complete(two.base_url, "beta", n=3)  # beta's own cap (max_n 2); alpha's is the server's (4)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert complete(two.base_url, "alpha", n=3).status_code == 200
    cards = {c["id"]: c for c in httpx.get(f"{two.base_url}/v1/models").json()["data"]}
    assert cards["alpha"]["state"] == cards["beta"]["state"] == "loaded"
    assert cards["alpha"]["load_seconds"] > 0 and cards["alpha"]["max_model_len"] == 256
    assert two.pid("alpha") != two.pid("beta") and os.getpid() not in (two.pid("alpha"), two.pid("beta"))
    metrics = httpx.get(f"{two.base_url}/metrics").text
    assert 'tokenmill:model_state{model_name="alpha",state="loaded"} 1.0' in metrics
    assert 'tokenmill:generation_tokens_total{model_name="beta"}' in metrics
    assert metrics.count("# TYPE tokenmill:generation_tokens_total counter") == 1  # one family, a sample a model
    two.assert_no_leaks()


def test_an_unknown_model_is_a_404_in_openais_shape(two: RunningPool) -> None:
    r = complete(two.base_url, "delta")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "The model 'delta' does not exist; this server serves alpha, beta.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert httpx.post(f"{two.base_url}/v1/models/delta/load").status_code == 404
    missing = httpx.post(f"{two.base_url}/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "model_required"
    two.assert_no_leaks()


def test_a_client_gone_while_its_model_loads_leaves_nothing_running(two: RunningPool) -> None:
    httpx.post(f"{two.base_url}/v1/models/alpha/unload", timeout=60)
    assert two.state("alpha") == "unloaded"
    with pytest.raises(httpx.ReadTimeout):
        complete(two.base_url, "alpha", timeout=0.3, max_tokens=200, ignore_eos=True)
    assert two.wait_for(lambda: two.state("alpha") == "loaded")  # the load goes on, for a retry
    time.sleep(0.5)
    stats = two.stats("alpha")
    assert stats.prompt_tokens == stats.generated_tokens == 0  # the request never reached the engine
    assert two.pool.entries["alpha"].users == 0
    two.assert_no_leaks()


def test_a_request_waiting_past_the_limit_gets_a_503_with_retry_after(folders: dict[str, Path], tmp_path) -> None:
    running = start_several(write_models_file(tmp_path, {"alpha": str(folders["alpha"])}), load_wait=0.2)
    try:
        r = complete(running.base_url, "alpha")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "model_loading"
        assert running.wait_for(lambda: running.state("alpha") == "loaded")
        assert complete(running.base_url, "alpha").status_code == 200
        running.assert_no_leaks()
    finally:
        running.stop()


def test_least_recently_used_models_are_unloaded_to_stay_under_memory(folders: dict[str, Path], tmp_path: Path) -> None:
    path = write_models_file(tmp_path, {k: str(v) for k, v in folders.items()})
    each = max(s.memory_bytes for s in read_models_file(str(path), tiny_base()))
    running = start_several(path, memory=2 * each + each // 2)  # room for two models, not three
    try:
        pids = {}
        for name in ("alpha", "beta"):
            assert complete(running.base_url, name).status_code == 200
            pids[name] = running.pid(name)
        assert complete(running.base_url, "alpha").status_code == 200  # alpha used last: beta is the LRU
        assert complete(running.base_url, "gamma").status_code == 200
        states = {n: running.state(n) for n in folders}
        assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert not psutil.pid_exists(pids["beta"]) or psutil.Process(pids["beta"]).status() == psutil.STATUS_ZOMBIE
        assert running.pool.used_bytes <= running.pool.settings.memory
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert 'tokenmill:model_unloads_total{model_name="beta",reason="memory"} 1.0' in metrics
        running.assert_no_leaks()
    finally:
        running.stop()


def test_a_model_too_big_for_the_memory_is_refused_at_start(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory: alpha alone needs about"):
        start_several(write_models_file(tmp_path, {"alpha": str(folders["alpha"])}), memory=1024)


@pytest.mark.slow  # (unload by idle time: ~10 s; `make test-all` runs it; explicit unload is in the default run)
def test_an_idle_model_is_unloaded(folders: dict[str, Path], tmp_path: Path) -> None:
    running = start_several(write_models_file(tmp_path, {"alpha": str(folders["alpha"])}), idle_unload=0.5)
    try:
        assert complete(running.base_url, "alpha").status_code == 200
        pid = running.pid("alpha")
        assert pid is not None
        assert running.wait_for(lambda: running.state("alpha") == "unloaded", 30)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert complete(running.base_url, "alpha").status_code == 200  # and loads again on demand
        running.assert_no_leaks()
    finally:
        running.stop()


def test_explicit_load_and_unload_are_behind_the_api_key(folders: dict[str, Path], tmp_path: Path) -> None:
    running = start_several(write_models_file(tmp_path, {"alpha": str(folders["alpha"])}), api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        base = running.base_url
        assert httpx.post(f"{base}/v1/models/alpha/load").status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert running.state("alpha") == "unloaded"
        card = httpx.post(f"{base}/v1/models/alpha/load", headers=auth, timeout=120).json()
        assert card["state"] == "loaded" and card["id"] == "alpha"
        pid = running.pid("alpha")
        assert pid is not None and psutil.pid_exists(pid)
        assert httpx.post(f"{base}/v1/models/alpha/unload").status_code == 401
        assert running.state("alpha") == "loaded"
        card = httpx.post(f"{base}/v1/models/alpha/unload", headers=auth, timeout=60).json()
        assert card["state"] == "unloaded" and card["unload_seconds"] > 0
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        r = httpx.post(
            f"{base}/v1/completions", headers=auth, json={"model": "alpha", "prompt": "x", "max_tokens": 2}, timeout=120
        )
        assert r.status_code == 200
        running.assert_no_leaks()
    finally:
        running.stop()


@pytest.mark.slow  # (a reload after a death; the default run keeps test_several_child_death's mid-stream kill)
def test_a_model_whose_process_died_loads_again(two: RunningPool) -> None:
    assert complete(two.base_url, "beta").status_code == 200
    pid = two.pid("beta")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    entry = two.pool.entries["beta"]
    assert two.wait_for(lambda: entry.served is None or not entry.served.engine.healthy)
    r = complete(two.base_url, "beta")
    assert r.status_code == 200, r.text
    assert two.pid("beta") not in (None, pid)
    two.assert_no_leaks()


def test_a_model_that_fails_to_load_answers_a_clear_500_and_wedges_nothing(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"  # a config.json passes the catalog's check; the weights do not load
    broken.mkdir()
    (broken / "config.json").write_bytes((folders["alpha"] / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    running = start_several(write_models_file(tmp_path, {"alpha": str(folders["alpha"]), "broken": str(broken)}))
    try:
        for _ in range(2):  # the failure is not remembered as a wedge: each try fails again, quickly
            r = complete(running.base_url, "broken")
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["code"] == "model_load_failed" and error["param"] == "model"
            assert "The model 'broken' failed to load" in error["message"]
            assert running.state("broken") == "unloaded"
        assert complete(running.base_url, "alpha").status_code == 200  # the other model still serves
        assert running.pool.entries["broken"].users == running.pool.entries["broken"].waiters == 0
        running.assert_no_leaks()
    finally:
        running.stop()
