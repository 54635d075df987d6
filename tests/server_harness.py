"""Runs a tokenmill server in-process on a free loopback port, for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from tokenmill.config import EngineConfig
from tokenmill.distributed.config import ParallelConfig
from tokenmill.outputs import EngineStats
from tokenmill.server.app import create_app
from tokenmill.server.front_door import FrontDoor
from tokenmill.server.launch import bind, build_server
from tokenmill.server.protocol import RequestCaps
from tokenmill.server.serving import Server
from tokenmill.server.settings import record_trace as record
from tokenmill.server.trace_recorder import TraceRecorder

KV_BLOCK_BYTES = 24576  # one 16-token block of the tiny llama, float32, all layers


@dataclass
class RunningServer:
    base_url: str
    server: Server
    uvicorn_server: uvicorn.Server
    thread: threading.Thread
    recorder: TraceRecorder | None = None

    def stats(self) -> EngineStats:
        return self.server.engine.stats()

    def wait_all_free(self, timeout: float = 10.0) -> EngineStats:
        """Engine stats once every KV block is free again (or the last stats at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            done = stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
            if done or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)
        if self.recorder is not None:
            self.recorder.close()


def start_server(
    model_dir: str,
    api_key: str | None = None,
    max_waiting: int = 8,
    blocks: int = 64,
    parallel: ParallelConfig | None = None,
    isolation: str = "api-key",
    prepare_app: Callable[[FastAPI], None] | None = None,
    front: FrontDoor | None = None,
    limits: RequestCaps | None = None,
    record_trace: tuple[str, str] | None = None,
    **engine: object,
) -> RunningServer:
    """`record_trace`: (file, privacy) to record finished requests to, as `serve --record-trace` does."""
    settings: dict = {"max_model_len": 256, "kv_cache_memory": blocks * KV_BLOCK_BYTES, **engine}
    config = EngineConfig(model=model_dir, **settings)
    server = build_server(
        config,
        "tiny",
        max_waiting=max_waiting,
        limits=limits or RequestCaps(max_n=4),
        log_interval=60,
        parallel=parallel,
        isolation=isolation,
    )
    recorder = record(server, *record_trace, 1 << 30) if record_trace is not None else None
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(server, api_key=api_key, front=front)
    if prepare_app is not None:  # (a test's own middleware, say)
        prepare_app(app)
    userver = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return RunningServer(base, server, userver, thread, recorder)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the test server did not start")
