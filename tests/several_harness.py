"""Runs a several-model tokenmill server (`serve --models`) in-process on a free loopback port, for the
tests of loading on demand; each model's engine runs in a child process, as served."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvicorn
import yaml

from tests.server_harness import KV_BLOCK_BYTES
from tokenmill.config import EngineConfig
from tokenmill.outputs import EngineStats
from tokenmill.server.front_door import FrontDoor
from tokenmill.server.launch import bind
from tokenmill.server.model_catalog import read_models_file
from tokenmill.server.model_pool import ModelPool, PoolSettings
from tokenmill.server.multi_app import create_multi_app, record_traces
from tokenmill.server.settings import ServeSettings

BLOCKS = 64  # each model's KV cache, in 16-token blocks of the tiny models


@dataclass
class RunningPool:
    base_url: str
    pool: ModelPool
    uvicorn_server: uvicorn.Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop

    def state(self, name: str) -> str:
        return self.pool.entries[name].state

    def pid(self, name: str) -> int | None:
        served = self.pool.entries[name].served
        return served.pid if served is not None else None

    def stats(self, name: str) -> EngineStats:
        served = self.pool.entries[name].served
        assert served is not None, f"{name} is not loaded"
        return served.engine.stats()

    def wait_for(self, check: Callable[[], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def assert_no_leaks(self) -> None:
        """Every loaded model's KV blocks free again, nothing running or waiting, no lease held."""
        for name, entry in self.pool.entries.items():
            assert self.wait_for(lambda e=entry: e.users == 0 and e.waiters == 0, 10), name  # type: ignore[misc]
            if entry.served is None:
                continue
            ok = self.wait_for(lambda n=name: _all_free(self.stats(n)), 10)  # type: ignore[misc]
            assert ok, f"{name}: {self.stats(name)}"

    def stop(self) -> None:
        """Stop the server: every model's process must be gone after."""
        pids = [e.served.pid for e in self.pool.entries.values() if e.served is not None]
        self.uvicorn_server.should_exit = True
        self.thread.join(60)
        for recorder in self.pool.traces.values():
            recorder.close()
        for pid in pids:
            assert not _alive(pid), f"process {pid} outlived the server"


def _all_free(stats: EngineStats) -> bool:
    return stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tiny_base(blocks: int = BLOCKS, **engine: Any) -> EngineConfig:
    """The engine settings the models of a test's models file start from."""
    return EngineConfig(model=".", max_model_len=256, kv_cache_memory=blocks * KV_BLOCK_BYTES, **engine)


def write_models_file(folder: Path, models: Mapping[str, Any]) -> Path:
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(dict(models)), encoding="utf-8")
    return path


def start_several(
    models_file: Path,
    memory: int | None = None,
    idle_unload: float | None = None,
    load_wait: float = 120.0,
    api_key: str | None = None,
    blocks: int = BLOCKS,
    record_trace: Mapping[str, Any] | None = None,
    **engine: Any,
) -> RunningPool:
    """`record_trace`: the served settings `record_trace`, `record_trace_privacy`, ... (each model its file)."""
    specs = read_models_file(str(models_file), tiny_base(blocks, **engine))
    front = FrontDoor(api_keys=(api_key,) if api_key else ())
    serve = ServeSettings(max_waiting=8, max_n=4, log_interval=60, drain_timeout=5, **(record_trace or {}))
    pool = ModelPool(specs, PoolSettings(memory, idle_unload, load_wait, 5.0), serve, front)
    pool.traces = record_traces(specs, serve)
    app = create_multi_app(pool, front)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    userver = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    loops: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        loops.append(loop)
        loop.run_until_complete(userver.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return RunningPool(base_url, pool, userver, thread, loops[0])
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the test server did not start")
