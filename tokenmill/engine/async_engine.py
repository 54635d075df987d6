"""AsyncEngine: engine cores behind CoreClients, the output processor and routing on the event loop.

Owns the front end's side of serving. Only plain messages reach the cores (`engine.messages`, through
`engine.core_client`): one core on a thread of this process by default, or N data-parallel replicas
(`tokenmill.distributed`), each request routed to one (`engine.router`: least loaded, or the replica
holding the longest cached prefix of its prompt). Requests are tokenized, checked and fanned out on
the event loop; the cores step while they have work and hand their outputs to the loop, where the
output processor turns them into RequestOutputs for each request's asyncio queue — so the event loop
never blocks on a model. A client that goes away aborts its request, whose blocks are freed within
one engine step. Admission is bounded by live state: a request whose sequences (prompts x n) would take
those waiting (in the cores, by their latest stats, and sent but not taken yet) past `max_waiting` is
refused (the server answers 429). The cores hand over fresh stats after every step and after commands
that leave them idle, so aborts free admission at once. The prompts of one request start together or
not at all (`submit`).

A request the engine failed alone (`RequestFailed`: its processors, its output, a step it was in)
gets that error and the others go on. A core whose loop ends unasked (an error outside any step; a
replica's process died) fails its open requests with a clear error, except those that have received
nothing yet, which go to another replica when there is one; the router sends nothing more to it, and
the watchdog (`restart`: the same core reset under a new loop in this process, a new Ray replica)
puts a core back in its place, which rejoins once ready. Nothing hangs: every open request gets an
output or an error.

Where a request runs beyond the router's pick is its `Placement`'s business (`engine/placement.py`):
`Direct` (whole, where routed) by default; prefill/decode disaggregation is a placement composed in
(`tokenmill.distributed.disaggregated`), which moves requests through `open_request`, `move` and
`fail_request`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tokenmill.engine.core_client import CoreClient, Restart
from tokenmill.engine.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest, StopRequests
from tokenmill.engine.metrics import EngineMetrics, sum_stats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.placement import Direct, Placement
from tokenmill.engine.request_checks import CheckedRequest
from tokenmill.engine.request_stream import RequestStream
from tokenmill.engine.router import ROUTING, Router, RouterConfig
from tokenmill.errors import RequestFailed, describe
from tokenmill.outputs import EngineStats, OutputKind, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class EngineOverloaded(Exception):
    """More requests wait than the server accepts; retry later."""


class EngineUnavailable(Exception):
    """No engine can take or finish the request now (HTTP 503); `code` says why."""

    code = "unavailable"


class EngineStopped(EngineUnavailable):
    """The engine is shutting down and takes no new requests."""

    code = "shutting_down"


class ReplicaLost(EngineUnavailable):
    """The engine replica running the request was lost after the request had produced output."""

    code = "replica_lost"


@dataclass
class OpenRequest:
    """An accepted request: where it runs, and what it takes to start it again elsewhere."""

    requests: list[EngineCoreRequest]
    every_step: bool  # hand every step over at once (streamed, or stop strings matched here)
    sink: asyncio.Queue[RequestOutput | BaseException]
    again: Callable[[], list[EngineCoreRequest]]  # registers the request anew: its new core requests
    replica: int  # where it runs
    handed: bool = False  # an output went to the caller: the request can no longer start over
    last_token: float = 0.0  # for the inter-token latency metric
    tokens: int = 0


@dataclass
class FinishedRequest:
    """A generation request that finished, for `AsyncEngine.on_finished` (built on the event loop)."""

    prompt_token_ids: list[int]  # the engine's own list: read-only
    output_tokens: int  # over all its sequences
    sequences: int  # n
    finish_reason: str  # the last sequence's to finish
    times: RequestMetrics  # time.monotonic() seconds
    cached_tokens: int  # prompt tokens served by the prefix cache


class AsyncEngine:
    def __init__(
        self,
        clients: Sequence[CoreClient],
        processor: OutputProcessor,
        metrics: EngineMetrics,
        max_waiting: int = 256,
        log_interval: float = 10.0,
        routing: str = "least_loaded",
        restart: Restart | None = None,
        placement: Placement | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting: expected a positive integer, got {max_waiting}")
        if not clients:
            raise ValueError("clients: expected at least one engine core")
        self.clients = list(clients)
        self.processor = processor
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        limits = processor.limits
        if routing not in ROUTING:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING)}, got {routing!r}")
        if routing == "prefix" and not limits.prefix_caching:
            routing = "least_loaded"  # nothing is cached to route by
        self.router = Router(len(self.clients), RouterConfig(routing, limits.block_size, limits.num_blocks))
        self._restart = restart
        self._open: dict[str, OpenRequest] = {}  # request id -> its state, on the event loop
        self._up = [False] * len(self.clients)  # the core's loop runs (started, not ended)
        self._waiting = [0] * len(self.clients)  # each core's waiting count after its last step
        self._restarting: set[int] = set()  # replicas being restarted (the watchdog's)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # draining or stopping: no new requests
        self._last_log = time.monotonic()
        self.placement = placement or Direct()
        self.placement.bind(self)
        # called on the event loop for each generation request that finishes (a trace recorder): must not block
        self.on_finished: Callable[[FinishedRequest], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every core's loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        for i, client in enumerate(self.clients):
            self._start_client(i, client)

    def _start_client(self, i: int, client: CoreClient) -> None:
        loop = self._loop
        assert loop is not None
        self._up[i] = True

        def deliver(steps: list[EngineCoreOutputs]) -> None:
            loop.call_soon_threadsafe(self._on_steps, i, client, steps)

        def stopped(failure: BaseException | None) -> None:
            loop.call_soon_threadsafe(self._on_client_stopped, i, client, failure)

        client.start(deliver, stopped)
        self.metrics.replica_up(i)

    def begin_drain(self) -> None:
        """Take no new requests (they get EngineStopped); the open ones run on."""
        self._stopping = True

    def request_stop(self) -> None:
        """Tell every core to abort what is left and end; returns at once."""
        self._stopping = True
        for client in self.clients:
            client.request_stop()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the cores and wait for them."""
        self.request_stop()
        deadline = time.monotonic() + timeout
        for client in self.clients:
            client.join(max(0.0, deadline - time.monotonic()))

    @property
    def healthy(self) -> bool:
        """Some core runs."""
        return self._loop is not None and any(self._up)

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: new requests are taken."""
        return self.healthy and not self._stopping

    @property
    def num_open(self) -> int:
        """Requests accepted that have not finished."""
        return len(self._open)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting now: in the running cores (their latest stats) and sent but not taken yet."""
        return sum(self._waiting[i] + c.num_pending for i, c in enumerate(self.clients) if self._up[i])

    def stats(self) -> EngineStats:
        """The cores' stats now, summed over the running replicas (all of them once none runs; may
        block briefly)."""
        live = [c for i, c in enumerate(self.clients) if self._up[i]] or self.clients
        stats = [c.stats() for c in live]
        return stats[0] if len(stats) == 1 else sum_stats(stats)

    # -- requests ----------------------------------------------------------------------------------

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
        stream = self.submit([(request_id, prompt)], params, cache_salt, output_kind)[0]
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def submit(
        self,
        prompts: Sequence[tuple[str, str | list[int] | CheckedRequest]],
        params: SamplingParams,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> list[RequestStream]:
        """Check, admit and start the prompts of one user request together: every one of them, or
        none (then EngineOverloaded, EngineStopped or a ValueError naming the field, with nothing
        left running). `prompts`: (request id, prompt) pairs, a prompt that passed the front door already
        as its CheckedRequest. Admission counts sequences: prompts x n."""
        self._admit_check(len(prompts) * params.n)
        arrival = time.monotonic()
        every_step = output_kind is not OutputKind.FINAL_ONLY or bool(params.stop)
        added: list[tuple[str, Callable[[], list[EngineCoreRequest]], list[EngineCoreRequest]]] = []
        streams: list[RequestStream] = []
        try:
            for request_id, prompt in prompts:  # every prompt checked before any starts
                add = functools.partial(
                    self.processor.add_request, request_id, prompt, params, arrival, cache_salt, output_kind
                )
                added.append((request_id, add, add()))
            for request_id, add, requests in added:
                streams.append(self._start(request_id, add, requests, every_step))
        except BaseException:
            for stream in streams:
                stream.close()
            for request_id, _, _ in added[len(streams) :]:
                self.processor.abort_request(request_id)
            raise
        return streams

    def _start(
        self,
        request_id: str,
        add: Callable[[], list[EngineCoreRequest]],
        requests: list[EngineCoreRequest],
        every_step: bool,
    ) -> RequestStream:
        """Send a registered request to a replica; its stream."""
        assert self._loop is not None, "start() first"
        replica = self._dispatch(requests, every_step, exclude=())
        entry = OpenRequest(requests, every_step, asyncio.Queue(), add, replica, last_token=requests[0].arrival_time)
        self._open[request_id] = entry
        return RequestStream(request_id, entry.sink, self._abort, self._loop)

    def _admit_check(self, sequences: int) -> None:
        """Refuse a request of `sequences` sequences that would take the waiting ones past
        `max_waiting` (one that finds none waiting always goes in, whatever its size)."""
        if not self.accepting:
            raise EngineStopped(self._why_not_accepting())
        waiting = self.num_waiting
        if waiting and waiting + sequences > self.max_waiting:
            raise EngineOverloaded(
                f"{waiting} sequences are waiting and this request brings {sequences} (the limit is {self.max_waiting})"
            )

    def _why_not_accepting(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        return "the engine is restarting" if self.recovering else "the engine is not running"

    def _dispatch(self, requests: list[EngineCoreRequest], every_step: bool, exclude: Sequence[int]) -> int:
        """Send a request's core requests to a replica the router picks, and return it; EngineStopped
        if none takes them."""
        first = requests[0]
        exclude = [*exclude, *self.placement.excluded()]
        while True:
            try:
                route = self.router.pick(first.prompt_token_ids, first.cache_salt, exclude)
            except LookupError:
                raise EngineStopped("no engine replica is running") from None
            if self.clients[route.replica].send_requests(self.placement.outgoing(route.replica, requests), every_step):
                self.router.load[route.replica] += 1
                self.metrics.observe_routed(route.replica, route.by_prefix)
                return route.replica
            exclude = [*exclude, route.replica]

    def _close(self, request_id: str) -> OpenRequest | None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            self.router.load[entry.replica] = max(0, self.router.load[entry.replica] - 1)
            self.placement.closed(entry.requests)
        return entry

    # -- for placements ----------------------------------------------------------------------------

    def open_request(self, request_id: str) -> OpenRequest | None:
        """An accepted request that has not finished (None: finished, failed or aborted)."""
        return self._open.get(request_id)

    def move(self, entry: OpenRequest, replica: int) -> None:
        """An open request runs on `replica` now (the router's load follows it)."""
        if entry.replica != replica:
            self.router.load[entry.replica] = max(0, self.router.load[entry.replica] - 1)
            self.router.load[replica] += 1
            entry.replica = replica

    def fail_request(self, request_id: str, error: BaseException) -> None:
        """End an open request with `error` (its caller gets it; the front end forgets the request)."""
        entry = self._close(request_id)
        if entry is not None:
            self.processor.abort_request(request_id)
            entry.sink.put_nowait(error)

    def _abort(self, request_id: str) -> None:
        entry = self._close(request_id)
        core_ids = self.processor.abort_request(request_id)
        if core_ids and entry is not None:
            self.clients[entry.replica].send(AbortRequests(core_ids))
            self.metrics.observe_aborted()

    # -- outputs (on the event loop) ---------------------------------------------------------------

    def _on_steps(self, replica: int, client: CoreClient, steps: list[EngineCoreOutputs]) -> None:
        if self.clients[replica] is not client:  # a replaced replica's last words
            return
        for outputs in steps:
            self._on_outputs(replica, outputs)

    def _on_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """One core step's outputs: RequestOutputs to their queues, metrics (the placement sees them
        before and after)."""
        self.placement.before_outputs(replica, outputs)
        processed = self.processor.process(outputs)
        if processed.stop_ids:
            self.clients[replica].send(StopRequests(processed.stop_ids))
        for request_id, error in processed.errors.items():  # refused by the core, or failed
            entry = self._close(request_id)
            if isinstance(error, RequestFailed):
                self.metrics.observe_request_fault()
            if entry is not None:
                entry.sink.put_nowait(error)
        now = time.monotonic()
        for out in processed.request_outputs:
            entry = self._open.get(out.request_id)
            if entry is None:
                continue
            self._observe(entry, out, now)
            entry.handed = True
            entry.sink.put_nowait(out)
            if out.finished:
                self._close(out.request_id)
        self._waiting[replica] = outputs.stats.waiting
        self.metrics.observe_step(outputs.stats, replica)
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            logger.info(self.metrics.log_line())
        self.placement.after_outputs(replica)

    def _observe(self, entry: OpenRequest, out: RequestOutput, now: float) -> None:
        tokens = entry.tokens + sum(len(c.token_ids) for c in out.outputs)  # delta outputs: new tokens only
        if tokens > entry.tokens:
            if entry.tokens > 0:
                self.metrics.observe_inter_token(now - entry.last_token)
            entry.last_token, entry.tokens = now, tokens
        if out.finished:
            for c in out.outputs:
                self.metrics.observe_finished(out.metrics, len(c.token_ids), c.finish_reason or "abort")
            if self.on_finished is not None and out.pooled is None:
                reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
                self.on_finished(
                    FinishedRequest(
                        out.prompt_token_ids,
                        entry.tokens,
                        len(entry.requests),
                        reasons[-1] if reasons else "stop",
                        out.metrics,
                        out.num_cached_tokens,
                    )
                )

    def _on_client_stopped(self, replica: int, client: CoreClient, failure: BaseException | None) -> None:
        """A core's loop has ended: its open requests start over on another replica (those that
        handed nothing to their caller yet: a non-streamed request until it finishes) or get the
        reason; nothing hangs."""
        if self.clients[replica] is not client:
            return
        self._up[replica] = False
        self._waiting[replica] = 0
        self.router.lost(replica)
        self.metrics.replica_lost(replica)
        unasked = failure is not None and not self._stopping
        if unasked:
            logger.error("engine replica %d ended: %s", replica, failure)
        for request_id, entry in list(self._open.items()):
            if entry.replica != replica:
                continue
            if unasked and not entry.handed:
                try:
                    self.processor.abort_request(request_id)
                    entry.requests = entry.again()
                    entry.replica = self._dispatch(entry.requests, entry.every_step, exclude=[replica])
                    logger.info("request %s moved from lost replica %d to %d", request_id, replica, entry.replica)
                    continue
                except EngineUnavailable:
                    pass
            self._close(request_id)
            self.processor.abort_request(request_id)
            entry.sink.put_nowait(self._why_ended(request_id, replica, failure))
        if unasked and self._restart is not None:
            self._restart_in_background(replica)

    def _why_ended(self, request_id: str, replica: int, failure: BaseException | None) -> BaseException:
        if failure is None or self._stopping:
            return EngineStopped("the server shut down")
        if len(self.clients) == 1:
            self.metrics.observe_request_fault()
            restarts = "; it restarts" if self._restart is not None else ""
            return RequestFailed(request_id, describe("the engine failed", failure) + restarts)
        return ReplicaLost(f"engine replica {replica} was lost ({failure})")

    @property
    def recovering(self) -> bool:
        """A core that ended unasked is being restarted."""
        return bool(self._restarting)

    def _restart_in_background(self, replica: int) -> None:
        """The watchdog's part: a core whose loop ended unasked is replaced (by `restart`: the same
        core reset under a new loop, or a new replica) and rejoins; /health is degraded meanwhile."""
        restart, loop = self._restart, self._loop
        assert restart is not None and loop is not None
        self._restarting.add(replica)

        def run() -> None:
            try:
                client = restart(replica)
                start = client.stats()  # (where its totals start: the same core's, or a new one's zeros)
            except Exception:
                logger.exception("engine replica %d could not be restarted", replica)
                loop.call_soon_threadsafe(self._restarting.discard, replica)
                return
            loop.call_soon_threadsafe(self._rejoin, replica, client, start)

        threading.Thread(target=run, name=f"tokenmill-restart-{replica}", daemon=True).start()

    def _rejoin(self, replica: int, client: CoreClient, start: EngineStats) -> None:
        self._restarting.discard(replica)
        if self._stopping:
            client.request_stop()
            return
        self.clients[replica] = client
        self.metrics.replica_restarted(replica, start)
        self._start_client(replica, client)
        self.router.rejoined(replica)
        logger.info("engine replica %d rejoined", replica)
