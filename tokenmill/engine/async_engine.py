"""AsyncEngine: the engine core on a background thread, the output processor on the event loop.

Owns the boundary between them. Only plain messages cross it (`engine.messages`: core requests,
aborts, stops, shutdown in; `EngineCoreOutputs` out), so the core could as well run in another
process. Requests are tokenized, checked and fanned out on the event loop; the core thread steps
while it has work and hands each step's outputs to the loop (`call_soon_threadsafe`), where the
output processor turns them into RequestOutputs for each request's asyncio queue — so the event
loop never blocks on the model. A client that goes away aborts its request, whose blocks are freed
within one engine step. Admission is bounded: past `max_waiting` requests waiting, new ones are
refused (the server answers 429). If the core thread dies, every open request gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, wait

from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopRequests,
)
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import EngineStats, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

Command = EngineCoreRequest | AbortRequests | StopRequests | Shutdown

# Steps whose outputs only non-streamed requests without stop strings await (final-only outputs) are
# handed to the event loop together, at least this often, instead of one wake-up per step: each
# wake-up takes a core from the step's thread team on a small machine (2 cores: bfloat16 at one
# request 222 -> 288 tok/s). A finished, failed, streamed or stop-string request is handed at once.
OUTPUT_INTERVAL_S = 0.025


class EngineOverloaded(Exception):
    """More requests wait than the server accepts; retry later."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        processor: OutputProcessor,
        metrics: EngineMetrics,
        max_waiting: int = 256,
        log_interval: float = 10.0,
        thread: EngineThread | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting: expected a positive integer, got {max_waiting}")
        self.core = core
        self.processor = processor
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        self._commands: queue.Queue[Command] = queue.Queue()
        # core request ids whose every step the event loop wants at once (streamed, or matched against
        # stop strings there); added by the loop before the request is queued, dropped by the core
        # thread when it finishes (set operations are atomic under the GIL)
        self._eager: set[str] = set()
        # event-loop side: request id -> its queue, and (last token time, tokens) for the ITL metric
        self._sinks: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._token_clock: dict[str, tuple[float, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards _pending, _stopping and _closed against the core thread
        self._pending = 0  # core requests sent, not yet taken by the core thread
        self._waiting = 0  # the core's waiting count after its last step
        self._stopping = False  # draining or stopping: no new requests
        self._closed = False  # the core thread has ended (or is ending)
        self._failure: BaseException | None = None
        self._last_log = time.monotonic()
        # the core's loop runs on this thread; give the one the core was built on (see engine_thread)
        self._thread = thread or EngineThread()
        self._running: Future[None] | None = None

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the core thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._running = self._thread.submit(self._run)

    def begin_drain(self) -> None:
        """Take no new requests (they get EngineStopped); the open ones run on."""
        with self._lock:
            self._stopping = True

    def request_stop(self) -> None:
        """Tell the core thread to abort what is left and end; returns at once."""
        with self._lock:
            self._stopping = True
            self._commands.put(Shutdown())

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the core thread and wait for it."""
        self.request_stop()
        if self._running is not None:
            wait([self._running], timeout)

    @property
    def healthy(self) -> bool:
        return self._running is not None and not self._running.done() and self._failure is None

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: new requests are taken."""
        return self.healthy and not self._stopping and not self._closed

    @property
    def num_open(self) -> int:
        """Requests accepted that have not finished."""
        return len(self._sinks)

    @property
    def num_waiting(self) -> int:
        return self._waiting + self._pending

    def stats(self) -> EngineStats:
        """The core's stats (read from the loop: a snapshot, as fresh as the last step)."""
        return self.core.stats()

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them, until it finishes. Raises
        EngineOverloaded or EngineStopped before anything is accepted, ValueError for a request that
        cannot run. Closing the iterator early (a client gone) aborts the request."""
        self._admit_check()
        requests = self.processor.add_request(request_id, prompt, params, None, cache_salt, output_kind)
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:  # checked and queued at once: the core thread never ends with it unseen
            if not self.accepting:
                self.processor.abort_request(request_id)
                raise EngineStopped("the server is shutting down")
            self._sinks[request_id] = sink
            self._token_clock[request_id] = (time.monotonic(), 0)
            self._pending += len(requests)
            for request in requests:
                if output_kind is not OutputKind.FINAL_ONLY or params.stop:
                    self._eager.add(request.request_id)
                self._commands.put(request)
        finished = False
        try:
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
                self._abort(request_id)

    def _admit_check(self) -> None:
        if not self.accepting:
            raise EngineStopped("the server is shutting down" if self.healthy else "the engine is not running")
        if self._waiting + self._pending >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are waiting (the limit is {self.max_waiting})")

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._token_clock.pop(request_id, None)
        core_ids = self.processor.abort_request(request_id)
        if core_ids:
            self._commands.put(AbortRequests(core_ids))
            self.metrics.observe_aborted()

    def _on_steps(self, steps: list[EngineCoreOutputs]) -> None:
        for outputs in steps:
            self._on_outputs(outputs)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """One core step's outputs, on the event loop: RequestOutputs to their queues, metrics."""
        processed = self.processor.process(outputs)
        if processed.stop_ids:
            self._commands.put(StopRequests(processed.stop_ids))
        for request_id, message in processed.errors.items():
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put_nowait(ValueError(message))
        now = time.monotonic()
        for out in processed.request_outputs:
            self._observe(out, now)
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink.put_nowait(out)
                if out.finished:
                    del self._sinks[out.request_id]
        self._waiting = outputs.stats.waiting
        self.metrics.observe_step(outputs.stats)
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            logger.info(self.metrics.log_line())

    def _observe(self, out: RequestOutput, now: float) -> None:
        last, seen = self._token_clock.get(out.request_id, (now, 0))
        tokens = seen + sum(len(c.token_ids) for c in out.outputs)  # delta outputs: new tokens only
        if tokens > seen:
            if seen > 0:
                self.metrics.observe_inter_token(now - last)
            self._token_clock[out.request_id] = (now, tokens)
        if out.finished:
            self._token_clock.pop(out.request_id, None)
            for c in out.outputs:
                self.metrics.observe_finished(out.metrics, len(c.token_ids), c.finish_reason or "abort")

    def _on_core_stopped(self, failure: BaseException | None) -> None:
        """The core thread has ended: every open request gets the reason, nothing hangs."""
        for request_id, sink in list(self._sinks.items()):
            sink.put_nowait(RuntimeError("the engine failed") if failure else EngineStopped("the server shut down"))
            self.processor.abort_request(request_id)
        self._sinks.clear()
        self._token_clock.clear()

    # -- core-thread side ------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._loop is not None, "start() from the event loop"
        loop = self._loop
        failure: BaseException | None = None
        held: list[EngineCoreOutputs] = []  # steps not yet handed to the loop
        handed = time.monotonic()
        try:
            while True:
                if not self._apply_commands(block=not self.core.has_unfinished()):
                    break
                if self.core.has_unfinished():
                    held.append(self.core.step())
                    now = time.monotonic()
                    idle = not self.core.has_unfinished()
                    if self._urgent(held[-1]) or idle or now - handed >= OUTPUT_INTERVAL_S:
                        loop.call_soon_threadsafe(self._on_steps, held)
                        held, handed = [], now
        except BaseException as e:  # the core died: fail every open request rather than hang it
            logger.exception("engine thread failed")
            failure = self._failure = e
        finally:
            with self._lock:  # no request is queued after this
                self._closed = True
            if held:  # what the requests got before the end reaches them first
                loop.call_soon_threadsafe(self._on_steps, held)
            self._abort_everything()
            loop.call_soon_threadsafe(self._on_core_stopped, failure)

    def _urgent(self, outputs: EngineCoreOutputs) -> bool:
        """Whether a step's outputs go to the loop now: a request streamed or matched against stop
        strings got tokens, or one finished or failed."""
        urgent = False
        for out in outputs.outputs:
            if out.finish_reason is not None or out.error is not None:
                self._eager.discard(out.request_id)
                urgent = True
            elif out.request_id in self._eager:
                urgent = True
        return urgent

    def _abort_everything(self) -> None:
        """Free every request's blocks (those queued but not taken included)."""
        try:
            while True:
                self._commands.get_nowait()
        except queue.Empty:
            pass
        try:
            self.core.abort_requests(list(self.core.scheduler.requests))
        except Exception:  # a core that failed may not abort cleanly; its requests are failed anyway
            logger.exception("could not abort the engine's requests")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False when told to stop."""
        while True:
            try:
                command = self._commands.get(timeout=self.log_interval) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(command, Shutdown):
                return False
            if isinstance(command, AbortRequests | StopRequests):
                self._eager.difference_update(command.request_ids)
            if isinstance(command, AbortRequests):
                self.core.abort_requests(command.request_ids)
            elif isinstance(command, StopRequests):
                self.core.stop_requests(command.request_ids)
            else:
                with self._lock:
                    self._pending -= 1
                self._add(command)

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:  # the front end checks the same limits: this is a disagreement, not a user error
            assert self._loop is not None
            self._eager.discard(request.request_id)
            refusal = EngineCoreOutputs(
                [_error_output(request.request_id, str(e))], self.core.stats(), self.core.last_step
            )
            self._loop.call_soon_threadsafe(self._on_outputs, refusal)


def _error_output(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, error=message)
