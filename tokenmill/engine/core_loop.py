"""CoreLoop: the engine core's side of a served engine — commands in, steps run, outputs handed over.

One loop drives one `EngineCore` on the thread that built it (see engine_thread): it applies the
queued commands (requests, aborts, stops, shutdown), steps while there is work, and hands the steps'
`EngineCoreOutputs` to `deliver`. Steps that only non-streamed requests await are handed together,
at least every `OUTPUT_INTERVAL_S`, instead of one hand-over per step: each wakes the consumer,
which on a small machine takes a core from the step's thread team. A finished, failed, streamed
or stop-string request (`every_step`) is handed at once.
Commands that leave the core idle (aborts of everything it held) run no step, so the loop then hands
over the stats alone: the front end's admission count and /metrics never wait on a step to come.

The same loop runs in the server's process (`LocalCoreClient`) and inside a Ray replica actor
(`tokenmill.distributed.replica`); only `deliver` differs. An error inside a step fails what it
belongs to (a request, the step's requests, or, escaping the step, every request the core holds) and
the loop goes on. When the loop ends (a shutdown, or an error outside any step) it frees every
request's blocks, so nothing leaks whatever the cause; the front end restarts a loop that ended unasked.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopRequests,
)
from tokenmill.errors import describe

logger = logging.getLogger("tokenmill")

Command = EngineCoreRequest | AbortRequests | StopRequests | Shutdown

OUTPUT_INTERVAL_S = 0.025


class CoreLoop:
    def __init__(self, core: EngineCore, deliver: Callable[[list[EngineCoreOutputs]], None]) -> None:
        """`deliver` gets the steps' outputs, in order, on the loop's thread."""
        self.core = core
        self._deliver = deliver
        self._commands: queue.Queue[Command] = queue.Queue()
        # core request ids whose every step is handed over at once; added before the request is
        # queued, dropped here when it finishes (set operations are atomic under the GIL)
        self.every_step: set[str] = set()
        self._lock = threading.Lock()  # guards `closed` against senders
        self.closed = False  # the loop has ended (or is ending): nothing sent is seen any more
        self.sent = 0  # requests queued for the core so far
        self.taken = 0  # requests the core has taken so far
        self._changed = False  # commands changed the core since the stats last went out
        self._held: list[EngineCoreOutputs] = []  # steps not yet handed over

    # -- any thread --------------------------------------------------------------------------------

    def send_requests(self, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        """Queue requests for the core (False, nothing queued, once the loop has ended)."""
        with self._lock:  # checked and queued at once: the loop never ends with one unseen
            if self.closed:
                return False
            for request in requests:
                if every_step:
                    self.every_step.add(request.request_id)
                self._commands.put(request)
            self.sent += len(requests)
            return True

    @property
    def pending(self) -> int:
        """Requests sent that the core has not taken yet."""
        return self.sent - self.taken

    def send(self, command: AbortRequests | StopRequests | Shutdown) -> None:
        self._commands.put(command)

    # -- the loop's thread -------------------------------------------------------------------------

    def run(self, idle_wait: float = 10.0) -> BaseException | None:
        """Step until a Shutdown (None) or a failure (returned, after logging it)."""
        failure: BaseException | None = None
        handed = time.monotonic()
        core = self.core
        try:
            while True:
                if not self._apply_commands(block=not core.has_unfinished(), idle_wait=idle_wait):
                    break
                if core.has_unfinished():
                    self._held.append(self._step())
                    self._changed = False  # (the step's outputs carry the stats)
                    now = time.monotonic()
                    idle = not core.has_unfinished()
                    if self._urgent(self._held[-1]) or idle or now - handed >= OUTPUT_INTERVAL_S:
                        self._hand_over()
                        handed = now
                elif self._changed:  # commands left the core idle (aborts): no step will carry the stats
                    self._hand_over(EngineCoreOutputs([], core.stats(), core.last_step))
        except BaseException as e:  # the core died: the caller fails every open request rather than hang it
            logger.exception("engine core failed")
            failure = e
        finally:
            with self._lock:  # nothing is queued after this
                self.closed = True
            if self._held:  # what the requests got before the end reaches them first
                self._hand_over()
            self._abort_everything()
        return failure

    def _hand_over(self, last: EngineCoreOutputs | None = None) -> None:
        """Deliver the held steps (then `last`), in order: each one's stats are newer than the one's before."""
        steps, self._held = self._held, []
        if last is not None:
            steps.append(last)
        self._changed = False
        self._deliver(steps)

    def _step(self) -> EngineCoreOutputs:
        """One core step. An error that escapes it (one no request owns: the core isolates those of a
        request and of a step's forward itself) fails every request the core holds, and it serves on."""
        try:
            return self.core.step()
        except Exception as e:
            return self.core.recover(e)

    def _urgent(self, outputs: EngineCoreOutputs) -> bool:
        """Whether a step's outputs go over now: an `every_step` request got tokens, or one finished or failed."""
        urgent = False
        for out in outputs.outputs:
            if out.finish_reason is not None or out.error is not None:  # (a fault finishes it: "error")
                self.every_step.discard(out.request_id)
                urgent = True
            elif out.request_id in self.every_step:
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

    def _apply_commands(self, block: bool, idle_wait: float) -> bool:
        """Apply queued commands (waiting for one when idle); False when told to stop."""
        while True:
            try:
                command = self._commands.get(timeout=idle_wait) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(command, Shutdown):
                return False
            self._changed = True
            if isinstance(command, AbortRequests | StopRequests):
                self.every_step.difference_update(command.request_ids)
            if isinstance(command, AbortRequests):
                self.core.abort_requests(command.request_ids)
            elif isinstance(command, StopRequests):
                self.core.stop_requests(command.request_ids)
            else:
                self.taken += 1
                self._add(command)

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
            return
        except ValueError as e:  # the front end checks the same limits: this is a disagreement, not a user error
            refusal = EngineCoreOutput(request.request_id, error=str(e), error_param=getattr(e, "param", None))
        except Exception as e:  # (a grammar that fails to compile, say): this request fails alone
            logger.warning("request %s could not be queued", request.request_id, exc_info=True)
            self.core.abort_requests([request.request_id])
            why = describe("the engine could not queue it", e)
            refusal = EngineCoreOutput(request.request_id, finish_reason="error", fault=why)
        self.every_step.discard(request.request_id)
        self._hand_over(EngineCoreOutputs([refusal], self.core.stats(), self.core.last_step))
