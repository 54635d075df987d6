"""ProcessCoreClient: the front end's `CoreClient` for an engine core in a spawned child process.

`spawn_core(config, name)` starts the child (a fresh interpreter, nothing of the server's state copied
in) running `engine.process_core.child_main`, and hands back a
`CoreProcess` at once; `CoreProcess.wait_ready()` blocks until the child has built its core (then a
`ProcessCoreClient`) or failed to (`CoreLoadFailed`, naming why), and `kill()` ends a child at any
point, a load in progress included (the waiter then gets `CoreLoadFailed`).

The client is what `AsyncEngine` expects of any core (see engine.core_client): requests and commands
go down the pipe as frames, a reader thread hands each batch of steps to `deliver` and the child's end
(its `ended` frame, or the pipe closing when the process died) to `stopped`, once. `stats()` asks the
child and waits for its answer, or gives the latest stats seen once the child has gone. `join`
waits for the process to exit and kills it past the timeout, so that nothing is left running.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import Deliver, Stopped
from tokenmill.engine.messages import AbortRequests, EngineCoreRequest, StopRequests, decode
from tokenmill.engine.process_core import (
    ConfigFrame,
    Ended,
    Ready,
    RequestBatch,
    StatsQuery,
    StatsReply,
    StepBatch,
    pack,
    unpack,
)
from tokenmill.engine.request_checks import EngineLimits
from tokenmill.outputs import EngineStats

STATS_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0


class CoreLoadFailed(RuntimeError):
    """A child process could not build its engine core (or was killed, or died, while it did)."""


class CoreProcess:
    """A spawned child building (then running) one engine core."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection, name: str) -> None:
        self.process = process
        self.conn = conn
        self.name = name

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> ProcessCoreClient:
        """Block until the core is built: its client; CoreLoadFailed if it could not be (or the child
        was killed or died meanwhile; the process is reaped then)."""
        try:
            kind, payload = unpack(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.kill()
            raise CoreLoadFailed(f"model {self.name}: its process ended while loading ({self.exit_status()})") from None
        if kind != "ready":
            why = decode(payload, Ended).failure if kind == "ended" else f"unexpected {kind!r} from its process"
            self.kill()
            raise CoreLoadFailed(f"model {self.name}: {why}")
        return ProcessCoreClient(self, decode(payload, Ready))

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the child to exit; whether it has."""
        try:
            self.process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self, close: bool = True) -> None:
        """End the child now (SIGKILL) and reap it, nothing of it left running; `close`: our end of the
        pipe too (not while a reader thread still reads it)."""
        if self.alive:
            self.process.kill()
        self.join(KILL_WAIT_S)
        if close:
            self.conn.close()

    def exit_status(self) -> str:
        self.join(KILL_WAIT_S)
        code = self.process.returncode
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def spawn_core(config: EngineConfig, name: str) -> CoreProcess:
    """Start a child process that builds an engine core for `config` (returns at once). The child is a
    fresh interpreter (`python -m tokenmill.engine.process_core`) importing this same tokenmill, its
    end of a socket pair passed as a file descriptor; the config is its first frame."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # (the folder holding this tokenmill package)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "tokenmill.engine.process_core", str(theirs.fileno()), name]
    try:
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    finally:
        theirs.close()  # (the child's end lives in the child: a closed pipe then means the child is gone)
    conn = Connection(ours.detach())
    conn.send_bytes(pack("config", ConfigFrame(json.dumps(dataclasses.asdict(config)))))
    return CoreProcess(process, conn, name)


class ProcessCoreClient:
    """The front end's handle on a core in a child process (see the module docstring)."""

    def __init__(self, child: CoreProcess, ready: Ready) -> None:
        self.child = child
        self._conn = child.conn
        self._limits = ready.limits
        self.pid = ready.pid
        self._last_stats = ready.stats
        self._lock = threading.Lock()  # guards the callbacks, the end and the stats asked
        self._send_lock = threading.Lock()
        self._deliver: Deliver | None = None
        self._stopped: Stopped | None = None
        self._ended = False
        self._failure: BaseException | None = None
        self._sent = 0
        self._taken = 0
        self._seq = itertools.count()
        self._asked: dict[int, Future[EngineStats]] = {}
        self._reader = threading.Thread(target=self._read, name=f"tokenmill-model-{child.name}", daemon=True)
        self._reader.start()

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def num_pending(self) -> int:
        return max(0, self._sent - self._taken)

    @property
    def ended(self) -> bool:
        return self._ended

    def start(self, deliver: Deliver, stopped: Stopped) -> None:
        with self._lock:
            self._deliver, self._stopped = deliver, stopped
            ended, failure = self._ended, self._failure
        if ended:  # (the child ended before the start: told now, once)
            stopped(failure)

    def _read(self) -> None:
        failure: BaseException | None = None
        try:
            while True:
                kind, payload = unpack(self._conn.recv_bytes())
                if kind == "steps":
                    batch = decode(payload, StepBatch)
                    self._taken = batch.taken
                    if batch.steps:
                        self._last_stats = batch.steps[-1].stats
                        assert self._deliver is not None, "steps before start()"
                        self._deliver(batch.steps)
                elif kind == "stats":
                    reply = decode(payload, StatsReply)
                    self._last_stats = reply.stats
                    with self._lock:
                        asked = self._asked.pop(reply.seq, None)
                    if asked is not None:
                        asked.set_result(reply.stats)
                elif kind == "ended":
                    ended = decode(payload, Ended)
                    failure = RuntimeError(ended.failure) if ended.failure else None
                    break
        except (EOFError, OSError):
            failure = RuntimeError(f"the model's process died ({self.child.exit_status()})")
        self._finish(failure)

    def _finish(self, failure: BaseException | None) -> None:
        with self._lock:
            self._ended, self._failure = True, failure
            stopped, asked, self._asked = self._stopped, list(self._asked.values()), {}
        for future in asked:
            future.set_result(self._last_stats)
        if stopped is not None:
            stopped(failure)

    def _send(self, kind: str, message: object | None = None) -> bool:
        frame = pack(kind, message)
        with self._send_lock:
            try:
                self._conn.send_bytes(frame)
                return True
            except (OSError, ValueError):  # the child has gone: the reader reports its end
                return False

    def send_requests(self, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        if self._ended:
            return False
        self._sent += len(requests)
        if not self._send("requests", RequestBatch(requests, every_step)):
            self._sent -= len(requests)
            return False
        return True

    def send(self, command: AbortRequests | StopRequests) -> None:
        if not self._ended:
            self._send("abort" if isinstance(command, AbortRequests) else "stop", command)

    def stats(self) -> EngineStats:
        """The child's stats now (the latest seen, once it has ended or does not answer in time)."""
        future: Future[EngineStats] = Future()
        with self._lock:
            if self._ended:
                return self._last_stats
            seq = next(self._seq)
            self._asked[seq] = future
        if not self._send("stats", StatsQuery(seq)):
            return self._last_stats
        try:
            return future.result(STATS_TIMEOUT_S)
        except TimeoutError:
            with self._lock:
                self._asked.pop(seq, None)
            return self._last_stats

    def request_stop(self) -> None:
        if not self._ended:
            self._send("shutdown")

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the child to exit, then kill it: nothing is left running."""
        self.child.join(timeout)
        self.child.kill(close=False)
        self._reader.join(KILL_WAIT_S)  # (the pipe reads its end once the process is gone)
        self._conn.close()
