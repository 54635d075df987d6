"""CoreClient: how the front end (AsyncEngine) reaches one engine core, wherever it runs.

A small protocol: send requests and commands, get each batch of steps' outputs through `deliver`
and the core's end through `stopped` (both called from a background thread), read its stats. Two
implementations: `LocalCoreClient` here (the core on a thread of the server's process, the default)
and `RayCoreClient` (`tokenmill.distributed.replica`: the core in a Ray actor, one per data-parallel
replica). The AsyncEngine routes between any number of them, and restarts one whose loop ended
unasked (`restart_in_place` for local cores). Moving a request's KV between cores is not part of it:
prefill/decode disaggregation's clients add that (`tokenmill.distributed.disaggregated.TransferClient`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Protocol

from tokenmill.engine.core import EngineCore
from tokenmill.engine.core_loop import CoreLoop
from tokenmill.engine.engine import engine_limits
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.engine.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest, Shutdown, StopRequests
from tokenmill.engine.output_processor import EngineLimits
from tokenmill.outputs import EngineStats

Deliver = Callable[[list[EngineCoreOutputs]], None]
Stopped = Callable[[BaseException | None], None]  # None: a requested stop; else why the core ended
Restart = Callable[[int], "CoreClient"]  # builds (and loads) a replacement for replica i; blocking


class CoreClient(Protocol):
    @property
    def limits(self) -> EngineLimits: ...

    @property
    def num_pending(self) -> int:
        """Requests sent that the core has not taken yet."""
        ...

    def start(self, deliver: Deliver, stopped: Stopped) -> None:
        """Start the core's loop; `deliver` and `stopped` are called from another thread."""
        ...

    def send_requests(self, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        """Queue requests (`every_step`: hand each of their steps over at once); False if the core has ended."""
        ...

    def send(self, command: AbortRequests | StopRequests) -> None: ...

    def stats(self) -> EngineStats:
        """The core's stats now (may block briefly: not for the event loop's hot path)."""
        ...

    def request_stop(self) -> None:
        """Ask the core to abort what it holds and end; returns at once (`stopped(None)` follows)."""
        ...

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the core to have ended."""
        ...


class LocalCoreClient:
    """The core on an EngineThread of this process (the thread that built it)."""

    def __init__(self, core: EngineCore, thread: EngineThread) -> None:
        self.core = core
        self._thread = thread
        self._limits = engine_limits(core)
        self._deliver: Deliver | None = None
        self.loop = CoreLoop(core, self._hand_over)
        self._running: Future[None] | None = None

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def num_pending(self) -> int:
        return self.loop.pending

    def start(self, deliver: Deliver, stopped: Stopped) -> None:
        self._deliver = deliver

        def run() -> None:
            stopped(self.loop.run())

        self._running = self._thread.submit(run)

    def _hand_over(self, steps: list[EngineCoreOutputs]) -> None:
        assert self._deliver is not None, "start() first"
        self._deliver(steps)

    def send_requests(self, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        return self.loop.send_requests(requests, every_step)

    def send(self, command: AbortRequests | StopRequests) -> None:
        self.loop.send(command)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def request_stop(self) -> None:
        self.loop.send(Shutdown())

    def join(self, timeout: float) -> None:
        if self._running is not None:
            wait([self._running], timeout)


def restart_in_place(cores: list[EngineCore], threads: list[EngineThread]) -> Restart:
    """The watchdog's restart for cores on threads of this process: replica i's core, reset (whatever
    requests are left aborted, the runner's rows cleared), under a new loop on its engine thread, or
    on a new thread where that one has died. The model and its KV cache stay loaded."""

    def restart(i: int) -> CoreClient:
        if not threads[i].alive:
            threads[i] = EngineThread()
        threads[i].run(cores[i].reset)
        return LocalCoreClient(cores[i], threads[i])

    return restart
