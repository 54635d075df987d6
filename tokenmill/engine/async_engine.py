"""AsyncEngine: the engine's step loop on a background thread, one asyncio queue per request.

Owns the boundary between the event loop and the engine. Every engine call happens on the engine
thread: requests and aborts arrive as plain commands on a thread-safe queue, outputs go back to each
request's asyncio queue through `call_soon_threadsafe`, so the event loop never blocks on the model.
A client that goes away aborts its request, whose blocks are freed within one engine step. Admission
is bounded: past `max_waiting` requests waiting, new ones are refused (the server answers 429).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.metrics import EngineGauges, EngineMetrics
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class EngineOverloaded(Exception):
    """More requests wait than the server accepts; retry later."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival: float
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    accepted: Future[None]


@dataclass
class AbortCommand:
    request_id: str


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, metrics: EngineMetrics, max_waiting: int = 256, log_interval: float = 10.0
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting: expected a positive integer, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        self._commands: queue.Queue[AddCommand | AbortCommand | None] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue[RequestOutput | BaseException], asyncio.AbstractEventLoop]] = {}
        self._token_clock: dict[str, tuple[float, int]] = {}  # request id -> (last token time, tokens)
        self._pending = 0  # add commands sent, not yet taken by the engine thread
        self._lock = threading.Lock()  # guards _pending, _stopping and _closed against the engine thread
        self._waiting = 0  # the engine's waiting count after its last step
        self._stopping = False  # draining or stopping: no new requests
        self._closed = False  # the engine thread has ended (or is ending)
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._failure: BaseException | None = None

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def begin_drain(self) -> None:
        """Take no new requests (they get EngineStopped); the open ones run on."""
        with self._lock:
            self._stopping = True

    def request_stop(self) -> None:
        """Tell the engine thread to abort what is left and end; returns at once."""
        with self._lock:
            self._stopping = True
            self._commands.put(None)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self.request_stop()
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: new requests are taken."""
        return self.healthy and not self._stopping and not self._closed

    @property
    def num_open(self) -> int:
        """Requests accepted (or on their way in) that have not finished."""
        return len(self._sinks) + self._pending

    @property
    def num_waiting(self) -> int:
        return self._waiting + self._pending

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them, until it finishes. Raises
        EngineOverloaded or EngineStopped before anything is accepted, ValueError for a request the
        engine refuses. Closing the iterator early (a client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: Future[None] = Future()
        with self._lock:  # checked and queued at once: the engine thread never ends with it unseen
            if not self.accepting:
                raise EngineStopped("the server is shutting down" if self.healthy else "the engine is not running")
            if self._waiting + self._pending >= self.max_waiting:
                raise EngineOverloaded(f"{self.num_waiting} requests are waiting (the limit is {self.max_waiting})")
            self._pending += 1
            command = AddCommand(request_id, prompt, params, cache_salt, time.monotonic(), sink, loop, accepted)
            self._commands.put(command)
        finished = False
        try:
            await asyncio.wrap_future(accepted)  # raises the engine's ValueError for a refused request
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(AbortCommand(request_id))

    # -- engine-thread side ----------------------------------------------------------------------

    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if now - last_log >= self.log_interval:
                    last_log = now
                    if self.engine.has_unfinished_requests() or self._waiting:
                        logger.info(self.metrics.log_line())
        except BaseException as e:  # the engine died: fail every open request rather than hang it
            logger.exception("engine thread failed")
            self._failure = e
            for sink, loop in self._sinks.values():
                loop.call_soon_threadsafe(sink.put_nowait, RuntimeError("the engine failed"))
        finally:
            with self._lock:  # no request is queued after this: refuse those queued but not taken
                self._closed = True
                while not self._commands.empty():
                    left = self._commands.get_nowait()
                    if isinstance(left, AddCommand):
                        left.accepted.set_exception(EngineStopped("the server shut down"))
            for request_id in list(self._sinks):
                if self.engine.abort_request(request_id):
                    self.metrics.observe_aborted()
            for sink, loop in self._sinks.values():
                loop.call_soon_threadsafe(sink.put_nowait, EngineStopped("the server shut down"))
            self._sinks.clear()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False when told to stop."""
        while True:
            try:
                command = self._commands.get(timeout=self.log_interval) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, AbortCommand):
                if self._sinks.pop(command.request_id, None) is not None:
                    if self.engine.abort_request(command.request_id):
                        self.metrics.observe_aborted()
                    self._token_clock.pop(command.request_id, None)
                continue
            with self._lock:
                self._pending -= 1
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, command.arrival, command.cache_salt
                )
            except ValueError as e:
                command.accepted.set_exception(e)
                continue
            except BaseException:
                command.accepted.set_exception(RuntimeError("the engine failed"))
                raise
            self._sinks[command.request_id] = (command.sink, command.loop)
            self._token_clock[command.request_id] = (command.arrival, 0)
            self._waiting += 1
            command.accepted.set_result(None)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            tokens = sum(len(c.token_ids) for c in out.outputs)
            last, seen = self._token_clock.get(out.request_id, (now, tokens))
            if tokens > seen:
                if seen > 0:
                    self.metrics.observe_inter_token(now - last)
                self._token_clock[out.request_id] = (now, tokens)
            if out.finished:
                self._token_clock.pop(out.request_id, None)
                for c in out.outputs:
                    self.metrics.observe_finished(out.metrics, len(c.token_ids), c.finish_reason or "abort")
            target = self._sinks.get(out.request_id)
            if target is not None:
                sink, loop = target
                loop.call_soon_threadsafe(sink.put_nowait, out)
                if out.finished:
                    del self._sinks[out.request_id]
        stats = self.engine.stats()
        self._waiting = int(stats["waiting"])
        self.metrics.observe_step(
            EngineGauges(
                running=int(stats["running"]),
                waiting=int(stats["waiting"]),
                kv_cache_usage=float(stats["kv_cache_usage"]),
                preemptions_total=int(stats["preemptions"]),
                prompt_tokens_total=int(stats["prompt_tokens"]),
                generation_tokens_total=int(stats["generated_tokens"]),
                prefix_cache_queries_total=int(stats["prefix_cache_queries"]),
                prefix_cache_hits_total=int(stats["prefix_cache_hits"]),
            )
        )
