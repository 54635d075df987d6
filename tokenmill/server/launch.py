"""Building and running the server: engine + AsyncEngine + app, served by uvicorn on a socket we bind.

Binding the socket here (port 0 allowed) lets the log say the real address, which tests read.
SIGTERM (or Ctrl-C) drains: the server keeps answering, but new requests and /health get a 503
(so a load balancer moves away and a client is told, not refused a connection) while the requests
in flight run to their end, for up to `drain_timeout` seconds; then the engine aborts what is left
(a stream gets an error event) and the process exits 0. A second Ctrl-C exits at once.

Connections run under header and body deadlines and a cap (connections.py), with the open-file limit
raised to its hard limit first; uvicorn's own concurrency limit sits just above that cap.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Protocol, cast

import uvicorn
from starlette.types import ASGIApp

from tokenmill.config import EngineConfig
from tokenmill.distributed.config import ParallelConfig
from tokenmill.engine import build_async_engine, front_end
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.model_files import is_gguf
from tokenmill.server.app import create_app
from tokenmill.server.connections import LISTEN_BACKLOG, connection_cap, guarded_protocol, raise_open_file_limit
from tokenmill.server.front_door import ConnectionLimits, FrontDoor
from tokenmill.server.protocol import RequestCaps
from tokenmill.server.serving import Server

logger = logging.getLogger("tokenmill")

# How long a thread waiting for the GIL lets the holder run before asking it to let go (Python's
# default: 5 ms). The event loop's Python per engine step (outputs, SSE chunks) otherwise runs to its
# end while the engine thread, back from a torch op, waits for it. Measured at one request
# (benchmarks/serve_overhead.py): the server's tokens/s went from 0.94-0.95 of offline's to 0.97;
# at 16 concurrent requests no difference either way.
SWITCH_INTERVAL_S = 0.0002


def build_server(
    config: EngineConfig,
    served_model_name: str | None = None,
    max_waiting: int = 64,
    limits: RequestCaps | None = None,
    log_interval: float = 10.0,
    parallel: ParallelConfig | None = None,
    isolation: str = "api-key",
) -> Server:
    """The server's engine: one core on a thread of this process, or with `parallel` (more than one
    replica, or a Ray address) data-parallel replicas on Ray, or prefill and decode replicas."""
    model = Path(config.model)
    name = served_model_name or (model.stem if is_gguf(model) else model.name)
    async_engine: AsyncEngine
    if parallel is None or not parallel.uses_ray:
        routing = parallel.routing if parallel is not None else "least_loaded"
        metrics = EngineMetrics(name, num_replicas=1)
        async_engine = build_async_engine(config, metrics, None, None, max_waiting, log_interval, routing)
    else:
        from tokenmill.distributed.replica import start_replicas

        clients, restart = start_replicas(config, parallel)
        metrics = EngineMetrics(name, num_replicas=len(clients))
        if parallel.disaggregated:
            from tokenmill.distributed.disaggregated import TransferClient, disaggregated_engine

            processor = front_end(config, clients)
            movers = cast(list[TransferClient], clients)  # (RayCoreClients: each moves KV between actors)
            prefill, decode = movers[: parallel.prefill_size], movers[parallel.prefill_size :]
            async_engine = disaggregated_engine(prefill, decode, processor, metrics, max_waiting, log_interval, restart)
        else:
            routing = parallel.routing
            async_engine = build_async_engine(config, metrics, clients, restart, max_waiting, log_interval, routing)
    processor = async_engine.processor
    tokenizer, max_model_len = processor.tokenizer, processor.limits.max_model_len
    return Server(async_engine, tokenizer, name, max_model_len, limits or RequestCaps(), isolation)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Its protocol is named (IPPROTO_TCP, not 0): asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on accepted sockets whose protocol says TCP, and with it on, the
    second write of a response on a kept-alive connection (a JSON body after its headers, each SSE
    event after the one before) waited for the client's delayed ACK, ~40 ms a request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


class Drainable(Protocol):
    """What the drain needs of what it drains: an AsyncEngine, or a several-model server's pool."""

    @property
    def num_open(self) -> int: ...

    def begin_drain(self) -> None: ...

    def request_stop(self) -> None: ...


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain between the signal and the exit (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: Drainable, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self.drain_started = time.monotonic()
        self.engine.begin_drain()
        logger.info(
            "%s: draining %d open requests (up to %.0f s); new requests get 503",
            signal.Signals(sig).name,
            self.engine.num_open,
            self.drain_timeout,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            left = self.engine.num_open
            if left and time.monotonic() - self.drain_started >= self.drain_timeout:
                logger.warning("drain timeout: aborting %d requests still open", left)
                left = 0
            if not left:
                self.engine.request_stop()  # aborts what is left; streams get an error event
                self.should_exit = True
        return await super().on_tick(counter)


def serve(
    server: Server,
    host: str,
    port: int,
    api_key: str | None,
    drain_timeout: float,
    front: FrontDoor | None = None,
    connections: ConnectionLimits | None = None,
    busiest: int = 0,
) -> None:
    """Serve until a signal (see the module docstring). `busiest`: the most requests the engine can
    hold (running + waiting), which the automatic connection cap stays above."""
    front = front or FrontDoor()
    app = create_app(server, api_key=api_key, front=front)
    keyed = bool(api_key or front.api_keys)
    serve_app(app, server.model_name, server.engine, host, port, keyed, drain_timeout, connections, busiest)


def serve_app(
    app: ASGIApp,
    what: str,
    engine: Drainable,
    host: str,
    port: int,
    keyed: bool,
    drain_timeout: float,
    connections: ConnectionLimits | None = None,
    busiest: int = 0,
) -> None:
    """Serve `app` (serving `what`, for the log) until a signal, draining `engine` (an AsyncEngine, or
    a several-model server's pool) first: see the module docstring."""
    connections = connections or ConnectionLimits()
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    open_files = raise_open_file_limit()
    cap = connection_cap(connections.max_connections, busiest, open_files)
    # the drain happens before uvicorn's own shutdown; it then only waits for the last bytes to go
    config = uvicorn.Config(
        app,
        log_level="info",
        timeout_graceful_shutdown=5,
        access_log=False,
        http=guarded_protocol(connections, cap),
        timeout_keep_alive=connections.keep_alive_timeout,  # type: ignore[arg-type]
        limit_concurrency=cap + 1,  # (the cap closes or refuses connections before uvicorn's 503)
        backlog=LISTEN_BACKLOG,  # (uvicorn's 2048 would let one burst of accepts pass the cap)
    )
    logger.info(
        "serving %s on http://%s:%d (API key %s; at most %d connections, open-file limit %d)",
        what,
        bound_host,
        bound_port,
        "required" if keyed else "not required",
        cap,
        open_files,
    )
    # uvicorn re-raises a signal that made it exit (a second Ctrl-C) under the handler in place
    # before it started. Make that handler a no-op, so the server exits 0 instead of dying of it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    DrainingServer(config, engine, drain_timeout).run(sockets=[sock])


def _drained(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped after %s; exiting", signal.Signals(signum).name)
