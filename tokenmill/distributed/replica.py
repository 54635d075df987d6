"""Data-parallel engine replicas on Ray: each an actor running an EngineCore, and its front-end client.

`ReplicaActor` runs in its own process (a Ray actor): it loads the model, builds an `EngineCore` on
the thread that steps it, and drives it with the same `CoreLoop` as a local server. Only the messages
of `engine.messages`, as JSON bytes, cross the process boundary: commands arrive through `submit`,
numbered by the client and applied in that order whatever order Ray delivers them in; steps' outputs
leave through `poll`, which waits until there are some (or the loop has ended).

`RayCoreClient` is the front end's `CoreClient` for one actor (and a disaggregated server's
`TransferClient`: its `handoff` has the decode actor fetch the prefill actor's KV through Ray's object
store): a pump thread long-polls the actor and hands the outputs to the AsyncEngine; an actor whose
process dies (or stops answering) ends the client with `stopped(error)`, and the AsyncEngine moves or
fails that replica's requests and asks `start_replicas`'s restart for a new actor in its place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.distributed.cluster import connect, ray_module
from tokenmill.distributed.config import ParallelConfig
from tokenmill.engine.core_client import CoreClient, Deliver, Stopped
from tokenmill.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopRequests,
    decode,
    encode,
)
from tokenmill.engine.output_processor import EngineLimits
from tokenmill.outputs import EngineStats
from tokenmill.runner.cpu_threads import physical_cores
from tokenmill.runner.kv_blocks import KVBlocks

logger = logging.getLogger("tokenmill")

POLL_S = 1.0  # a poll returns after this long without outputs (the client then polls again)
POLL_GRACE_S = 60.0  # a poll not answered this long after its wait: the actor is taken for lost
LOAD_TIMEOUT_S = 600.0  # a replica loading its model (and tuning its kernels on a new machine)
FETCH_TIMEOUT_S = 60.0  # a handoff's KV from the prefill replica


@dataclass
class RequestBatch:
    requests: list[EngineCoreRequest]
    every_step: bool


@dataclass
class PollResult:
    steps: list[EngineCoreOutputs]
    taken: int  # requests the core has taken so far
    ended: bool  # the core's loop has ended: nothing more will come
    failure: str | None = None  # why, when it failed


class ReplicaActor:
    """One engine core in a Ray actor process (made remote by `start_replicas`)."""

    def __init__(self, config_json: str, transfer: bool = False) -> None:
        """`transfer`: a disaggregated server's replica (its KV goes out of prefills, into handoffs)."""
        from tokenmill.distributed.kv_transfer import TransferConnector
        from tokenmill.engine.core import EngineCore
        from tokenmill.engine.core_loop import CoreLoop
        from tokenmill.engine.engine_thread import EngineThread

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = EngineConfig(**json.loads(config_json))
        self._transfer = TransferConnector(config.block_size) if transfer else None
        self._thread = EngineThread()
        self._core = self._thread.run(lambda: EngineCore(config, self._transfer))
        self._cond = threading.Condition()
        self._outbox: list[EngineCoreOutputs] = []
        self._ended = False
        self._failure: str | None = None
        self._loop = CoreLoop(self._core, self._put)
        self._order = threading.Lock()
        self._next = 0  # the number of the next command to apply
        self._early: dict[int, tuple[str, bytes, KVBlocks | None]] = {}  # commands that came before their turn
        self._thread.submit(self._run)

    def _run(self) -> None:
        failure = self._loop.run()
        with self._cond:
            self._ended = True
            self._failure = f"{type(failure).__name__}: {failure}" if failure is not None else None
            self._cond.notify_all()

    def _put(self, steps: list[EngineCoreOutputs]) -> None:
        with self._cond:
            self._outbox.extend(steps)
            self._cond.notify_all()

    def limits(self) -> bytes:
        from tokenmill.engine.engine import engine_limits

        return encode(engine_limits(self._core))

    def submit(self, seq: int, kind: str, payload: bytes, refs: list[Any] | None = None) -> None:
        """Command number `seq` (from 0): applied once every earlier one has been. `refs`: a handoff's
        KV, as a Ray object reference (in a list, so that Ray leaves fetching it to this call), fetched
        before the command waits its turn (a slow fetch holds up no other command)."""
        blocks = None
        if kind == "handoff":
            transfer = self._transfer
            assert transfer is not None, "a handoff goes to a disaggregated server's replica"
            start = time.perf_counter()
            blocks = _fetch(refs[0])  # from the prefill replica, through Ray's object store
            transfer.add_seconds(time.perf_counter() - start)
        with self._order:
            self._early[seq] = (kind, payload, blocks)
            while self._next in self._early:
                self._apply(*self._early.pop(self._next))
                self._next += 1

    def _apply(self, kind: str, payload: bytes, blocks: KVBlocks | None) -> None:
        if kind == "handoff":
            batch = decode(payload, RequestBatch)
            (request,) = batch.requests
            assert self._transfer is not None
            self._transfer.put(request.request_id, blocks)
            self._loop.send_requests(batch.requests, batch.every_step)
        elif kind == "requests":
            batch = decode(payload, RequestBatch)
            self._loop.send_requests(batch.requests, batch.every_step)  # refused once ended: poll says so
        elif kind == "abort":
            self._loop.send(decode(payload, AbortRequests))
        elif kind == "stop":
            self._loop.send(decode(payload, StopRequests))
        elif kind == "shutdown":
            self._loop.send(Shutdown())
        else:
            raise ValueError(f"kind: unknown command {kind!r}")

    def poll(self, timeout: float) -> bytes:
        """The steps' outputs since the last poll, waiting up to `timeout` seconds for some."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._outbox) or self._ended, timeout)
            steps, self._outbox = self._outbox, []
            return encode(PollResult(steps, self._loop.taken, self._ended, self._failure))

    def stats(self) -> bytes:
        return encode(self._core.stats())

    def take_kv(self, request_id: str) -> KVBlocks | None:
        """A finished prefill's KV (once), for the decode replica its request goes to."""
        return self._transfer.take(request_id) if self._transfer is not None else None

    def drop_kv(self, request_ids: list[str]) -> None:
        if self._transfer is not None:
            self._transfer.drop(request_ids)


class RayCoreClient:
    """The front end's handle on one ReplicaActor (see the module docstring)."""

    def __init__(self, actor: Any, limits: EngineLimits, index: int) -> None:
        self.actor = actor
        self.index = index
        self._limits = limits
        self._lock = threading.Lock()
        self._seq = 0
        self._sent = 0
        self._taken = 0
        self._ended = False
        self._pump: threading.Thread | None = None

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def num_pending(self) -> int:
        return max(0, self._sent - self._taken)

    def start(self, deliver: Deliver, stopped: Stopped) -> None:
        self._pump = threading.Thread(
            target=self._run, args=(deliver, stopped), name=f"tokenmill-replica-{self.index}", daemon=True
        )
        self._pump.start()

    def _run(self, deliver: Deliver, stopped: Stopped) -> None:
        ray = ray_module()
        try:
            while True:
                data = ray.get(self.actor.poll.remote(POLL_S), timeout=POLL_S + POLL_GRACE_S)
                result = decode(data, PollResult)
                self._taken = result.taken
                if result.steps:
                    deliver(result.steps)
                if result.ended:
                    self._ended = True
                    stopped(RuntimeError(result.failure) if result.failure else None)
                    return
        except Exception as e:  # the actor died, or stopped answering: this replica is lost
            self._ended = True
            why = "its process died" if isinstance(e, ray.exceptions.RayActorError) else f"{type(e).__name__}: {e}"
            stopped(RuntimeError(why))
            self._kill()

    def _submit(self, kind: str, payload: bytes, refs: list[Any] | None = None) -> None:
        with self._lock:  # numbered in the order sent
            seq, self._seq = self._seq, self._seq + 1
            self.actor.submit.remote(seq, kind, payload, refs)

    def send_requests(self, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        if self._ended:
            return False
        self._sent += len(requests)
        self._submit("requests", encode(RequestBatch(requests, every_step)))
        return True

    def send(self, command: AbortRequests | StopRequests) -> None:
        if not self._ended:
            self._submit("abort" if isinstance(command, AbortRequests) else "stop", encode(command))

    def handoff(self, request: EngineCoreRequest, every_step: bool, source: CoreClient) -> bool:
        assert isinstance(source, RayCoreClient), "a prefill replica on Ray"
        if self._ended:
            return False
        self._sent += 1
        kv = source.actor.take_kv.remote(request.request_id)  # fetched by this actor, from that one
        self._submit("handoff", encode(RequestBatch([request], every_step)), [kv])
        return True

    def drop_kv(self, request_ids: list[str]) -> None:
        if not self._ended:
            self.actor.drop_kv.remote(request_ids)

    def stats(self) -> EngineStats:
        return decode(ray_module().get(self.actor.stats.remote(), timeout=30), EngineStats)

    def request_stop(self) -> None:
        if not self._ended:
            self._submit("shutdown", b"")

    def join(self, timeout: float) -> None:
        if self._pump is not None:
            self._pump.join(timeout)
        self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray_module().kill(self.actor, no_restart=True)


def start_replicas(config: EngineConfig, parallel: ParallelConfig) -> tuple[list[CoreClient], Any]:
    """Start the replica actors (`parallel.num_replicas`: data-parallel ones, or a disaggregated
    server's prefill replicas then its decode ones; each with its share of the CPU threads) and wait
    for them to load; their clients, and the restart function for a lost one."""
    n = parallel.num_replicas
    threads = max(1, (config.cpu_threads or physical_cores()) // n)
    connect(parallel.ray_address, num_cpus=threads * n)
    ray = ray_module()
    replica_config = json.dumps(dataclasses.asdict(dataclasses.replace(config, cpu_threads=threads)))
    actor_class = ray.remote(num_cpus=threads, max_concurrency=4)(ReplicaActor)
    tag = uuid.uuid4().hex[:8]
    launches = itertools.count()

    def launch(i: int) -> Any:  # named for `ray list actors`; a restarted replica gets a new name
        name = f"tokenmill-{tag}-replica-{i}.{next(launches)}"
        return actor_class.options(name=name).remote(replica_config, parallel.disaggregated)

    def ready(i: int, actor: Any) -> RayCoreClient:
        try:
            limits = decode(ray.get(actor.limits.remote(), timeout=LOAD_TIMEOUT_S), EngineLimits)
        except ray.exceptions.RayActorError as e:
            ray.kill(actor, no_restart=True)
            raise ValueError(f"engine replica {i} failed to start: {_cause(e)}") from None
        return RayCoreClient(actor, limits, i)

    actors = [launch(i) for i in range(n)]  # they load at once, each on its own threads
    clients: list[CoreClient] = []
    try:
        for i, actor in enumerate(actors):
            clients.append(ready(i, actor))
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    logger.info("%d engine replicas on Ray, %d threads each", n, threads)

    def restart(i: int) -> CoreClient:
        logger.info("restarting engine replica %d", i)
        return ready(i, launch(i))

    return clients, restart


def _fetch(ref: Any) -> KVBlocks | None:
    """A handoff's KV from the prefill replica (None if it cannot come: that replica is gone, or its
    copy was dropped; the request then recomputes its prompt)."""
    try:
        blocks = ray_module().get(ref, timeout=FETCH_TIMEOUT_S)
    except Exception as e:
        logger.warning("a handoff's KV did not arrive: %s", _cause(e))
        return None
    return blocks if isinstance(blocks, KVBlocks) else None


def _cause(e: BaseException) -> str:
    """The error a replica's constructor raised, without Ray's wrapping."""
    cause = getattr(e, "cause", None) or getattr(e, "error_msg", None) or e
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(e).__name__
