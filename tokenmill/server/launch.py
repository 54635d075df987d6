"""Building and running the server: engine + AsyncEngine + app, served by uvicorn on a socket we bind.

Binding the socket here (port 0 allowed) lets the log say the real address, which tests read.
SIGTERM (or Ctrl-C) drains: uvicorn stops accepting, lets in-flight requests finish for up to
`drain_timeout` seconds, then the engine aborts what is left and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.server.app import create_app
from tokenmill.server.protocol import Limits
from tokenmill.server.serving import Server

logger = logging.getLogger("tokenmill")


def build_server(
    config: EngineConfig,
    served_model_name: str | None = None,
    max_waiting: int = 64,
    limits: Limits | None = None,
    log_interval: float = 10.0,
) -> Server:
    engine = LLMEngine(config)
    name = served_model_name or Path(config.model).name
    async_engine = AsyncEngine(engine, EngineMetrics(name), max_waiting=max_waiting, log_interval=log_interval)
    return Server(async_engine, engine.tokenizer, name, engine.max_model_len, limits or Limits())


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def serve(server: Server, host: str, port: int, api_key: str | None, drain_timeout: float) -> None:
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    app = create_app(server, api_key=api_key)
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=int(drain_timeout), access_log=False)
    logger.info(
        "serving %s on http://%s:%d (API key %s)",
        server.model_name,
        bound_host,
        bound_port,
        "required" if api_key else "not required",
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was in place
    # before it started. Make that handler a no-op, so a drained server exits 0 instead of dying of it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    uvicorn.Server(config).run(sockets=[sock])


def _drained(signum: int, frame: FrameType | None) -> None:
    logger.info("drained after %s; exiting", signal.Signals(signum).name)
