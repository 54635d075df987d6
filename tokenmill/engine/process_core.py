"""An engine core in a child process of its own: the child's side, and the frames both sides exchange.

`child_main` is what a spawned child runs (`engine.process_client` spawns it, as `python -m
tokenmill.engine.process_core FD NAME`, FD its end of a socket pair): it reads the config, builds an
`EngineCore` on the thread that will step it (see engine_thread; torch's thread count is set there
from the config's `cpu_threads`, in this process alone), says `ready` with the core's limits, then
drives it with the same `CoreLoop` as a core on a thread of the server, reading commands from its end
of a pipe and writing each hand-over of steps to it. When the loop ends (a shutdown, the parent gone:
its end of the pipe closed, or a failure) the child says `ended` and exits at once (`os._exit`): the
whole of its memory, weights and KV cache, goes back to the system with the process.

On the pipe, one frame per message: a kind (ASCII), a newline, and the message as JSON bytes
(`engine.messages.encode`: msgspec, no pickle). Commands in order on one pipe are applied in that
order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.engine.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest, StopRequests, decode, encode
from tokenmill.engine.request_checks import EngineLimits
from tokenmill.outputs import EngineStats

logger = logging.getLogger("tokenmill")


@dataclass
class ConfigFrame:
    config_json: str  # the EngineConfig's fields, as JSON


@dataclass
class RequestBatch:
    requests: list[EngineCoreRequest]
    every_step: bool


@dataclass
class StepBatch:
    steps: list[EngineCoreOutputs]
    taken: int  # requests the core has taken so far


@dataclass
class StatsQuery:
    seq: int


@dataclass
class StatsReply:
    seq: int
    stats: EngineStats


@dataclass
class Ready:
    limits: EngineLimits
    stats: EngineStats
    pid: int


@dataclass
class Ended:
    failure: str | None = None  # why the core's loop ended, when it failed (None: asked to stop)
    load_failed: bool = False  # the core could not be built: `failure` says why


def pack(kind: str, message: object | None = None) -> bytes:
    """One frame: `kind`, a newline, the message's JSON (empty for none)."""
    return kind.encode("ascii") + b"\n" + (encode(message) if message is not None else b"")


def unpack(frame: bytes) -> tuple[str, bytes]:
    kind, _, payload = frame.partition(b"\n")
    return kind.decode("ascii"), payload


class ChildSide:
    """The child's end of the pipe: frames out under a lock (the engine thread and the main thread
    both write), commands in, applied to the core's loop."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, message: object | None = None) -> None:
        frame = pack(kind, message)
        # (OSError: the parent has gone; the loop ends on the closed pipe)
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.conn.send_bytes(frame)


def child_main(conn: Connection, name: str) -> None:
    """A spawned child's life: read the config, build the core, serve commands until the loop ends, exit.
    The server owns it: a Ctrl-C or SIGTERM sent to the server's whole process group leaves it be (the
    server drains, then stops it; a server gone closes the pipe, which ends it)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _log_to_stderr(name)
    side = ChildSide(conn)
    try:
        kind, payload = unpack(conn.recv_bytes())
        if kind != "config":
            raise ValueError(f"expected the config first, got {kind!r}")
        code = _serve(decode(payload, ConfigFrame).config_json, side)
    except BaseException as e:  # (nothing may escape without the parent hearing of it)
        logger.exception("model %s: its process failed", name)
        side.send("ended", Ended(f"{type(e).__name__}: {e}"))
        code = 1
    for handler in logging.getLogger("tokenmill").handlers:
        handler.flush()
    conn.close()
    os._exit(code)  # at once: no interpreter teardown of torch's state; the memory goes with the process


def _serve(config_json: str, side: ChildSide) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.core_loop import CoreLoop
    from tokenmill.engine.engine import engine_limits
    from tokenmill.engine.engine_thread import EngineThread
    from tokenmill.errors import describe

    thread = EngineThread()
    try:
        config = EngineConfig(**json.loads(config_json))
        core = thread.run(lambda: EngineCore(config))  # built on the thread that steps it
    except Exception as e:
        logger.exception("the model could not be loaded")
        side.send("ended", Ended(describe("the model could not be loaded", e), load_failed=True))
        return 1
    loop: CoreLoop | None = None

    def hand_over(steps: list[EngineCoreOutputs]) -> None:
        assert loop is not None
        side.send("steps", StepBatch(steps, loop.taken))

    loop = CoreLoop(core, hand_over)
    side.send("ready", Ready(engine_limits(core), core.stats(), os.getpid()))
    running = thread.submit(loop.run)
    _read_commands(side, loop, core, running)
    failure = running.result()
    side.send("ended", Ended(None if failure is None else f"{type(failure).__name__}: {failure}"))
    return 0 if failure is None else 1


def _read_commands(side: ChildSide, loop: Any, core: Any, running: Any) -> None:
    """Apply the parent's commands until the loop has ended; a closed pipe (the parent gone) is a shutdown."""
    from tokenmill.engine.messages import Shutdown

    conn = side.conn
    while not running.done():
        try:
            if not conn.poll(0.2):
                continue
            kind, payload = unpack(conn.recv_bytes())
        except (EOFError, OSError):
            loop.send(Shutdown())
            break
        if kind == "requests":
            batch = decode(payload, RequestBatch)
            loop.send_requests(batch.requests, batch.every_step)  # refused once ended: the loop's end says so
        elif kind == "abort":
            loop.send(decode(payload, AbortRequests))
        elif kind == "stop":
            loop.send(decode(payload, StopRequests))
        elif kind == "stats":
            side.send("stats", StatsReply(decode(payload, StatsQuery).seq, core.stats()))
        elif kind == "shutdown":
            loop.send(Shutdown())
        else:
            logger.error("unknown command %r from the server", kind)


def _log_to_stderr(name: str) -> None:
    """tokenmill's log lines of this child to stderr, as the server's, each naming the model."""
    log = logging.getLogger("tokenmill")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(name)s [{name}]: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


if __name__ == "__main__":  # python -m tokenmill.engine.process_core FD NAME (engine.process_client spawns it)
    child_main(Connection(int(sys.argv[1])), sys.argv[2])
