"""EngineThread: the one thread a served engine's torch work runs on, from loading to the last step.

On CPU, torch's parallel ops run on an OpenMP thread team that belongs to the thread calling them.
When two threads of one process call parallel ops (the server's main thread while it loads and
tunes the model, the engine thread while it steps), each gets its own team, and OpenMP, seeing more
of its threads than cores, stops spinning between parallel regions and puts them to sleep: every
parallel op then pays a wake-up. Measured on a 2-core machine, one native linear call of a decode
step: 23 us from the thread that alone uses OpenMP, 72 us from a second thread; a served step was
45% slower than the same step offline. So the server builds its engine core on this thread and then
runs the core's loop on it: every parallel op of the process comes from one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs the callables given to it, one at a time, in order."""

    def __init__(self, name: str = "tokenmill-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the thread after what was submitted before; its result (or error) in the future."""
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and wait for it; its exception is raised here."""
        return self.submit(fn).result()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, who decides
                future.set_exception(e)
