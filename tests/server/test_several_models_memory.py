"""Unloading a model of a several-model server gives its memory back to the system: its weights and
KV cache lived in its child process, which exits. Measured on the server's process tree (this test
process, which runs the server, and its children) with a model big enough to tell (make-model's
`small` size: 220 MB of float32 weights)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import psutil
import pytest

from tests.several_harness import start_several, write_models_file
from tokenmill.tools.make_model import make_model


def tree_rss() -> int:
    """Resident bytes of this process and all its descendants."""
    me = psutil.Process(os.getpid())
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("llama", "small", tmp_path_factory.mktemp("small-llama"), seed=3)


def test_unloading_a_model_returns_its_memory(small_model: Path, tmp_path: Path) -> None:
    models = {"big": {"path": str(small_model), "kv_cache_memory": "8MiB", "max_model_len": 256}}
    running = start_several(write_models_file(tmp_path, models))
    try:
        base = running.base_url
        before = tree_rss()
        assert httpx.post(f"{base}/v1/models/big/load", timeout=300).json()["state"] == "loaded"
        body = {"model": "big", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200
        weights = running.stats("big").weight_bytes
        assert weights > 200 * 2**20
        pid = running.pid("big")
        assert pid is not None
        running.assert_no_leaks()
        loaded = tree_rss()
        assert loaded - before >= weights  # (the weights, the KV cache and the child's interpreter)
        assert httpx.post(f"{base}/v1/models/big/unload", timeout=120).json()["state"] == "unloaded"
        after = tree_rss()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert loaded - after >= 0.8 * weights, (before, loaded, after, weights)
    finally:
        running.stop()
