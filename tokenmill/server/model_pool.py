"""ModelPool: which models of a several-model server are loaded, loading on demand and unloading.

Each model of the catalog is `unloaded`, `loading`, `loaded` or `unloading`. A request takes a lease
on its model (`acquire`): at once when it is loaded; else it starts the load (when its memory fits)
and waits, with the others asking for it, up to `load_wait` seconds, past which it gets
`ModelNotReady` (the server's 503 with a Retry-After: the load goes on, and a retry finds it done).
A lease is held until the response has been sent whole; a model with leases is never unloaded.

Memory (`memory`: a budget in bytes, or none): models loading, loaded or unloading count their
estimate (`ModelSpec.memory_bytes`, its weights corrected to what the child reports once loaded).
A load that would pass the budget first unloads the least recently used loaded models that no
request holds or waits for, and starts once their processes have exited; while no such model is
left, it waits. `idle_unload` unloads a model no request has used for that many seconds. A model
whose child died is unloaded (what it ran failed with the engine's error) and loads again on the
next request. Loading is a child process building its core (`spawn_core`) and the front end built
around it here, on a thread (`served_model.load_model`); unloading stops the engine, whose child
exits (killed past `drain_timeout`). Everything runs on the event loop but the blocking parts, so
the pool's state needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine import spawn_core
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.server.front_door import FrontDoor
from tokenmill.server.model_catalog import ModelSpec
from tokenmill.server.pool_metrics import PoolMetrics
from tokenmill.server.served_model import ServedModel, forget_endpoints, load_model
from tokenmill.server.settings import ServeSettings
from tokenmill.server.trace_recorder import TraceRecorder

logger = logging.getLogger("tokenmill")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
DEFAULT_RETRY_S = 5  # Retry-After when no load time is known yet
STOP_WAIT_S = 10.0  # a child's time to exit once asked (then it is killed)


class ModelNotFound(LookupError):
    """A request named a model the server does not serve (HTTP 404)."""


class ModelNotReady(Exception):
    """The model did not load (or find memory to load in) within the wait (HTTP 503, Retry-After)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelLoadFailed(Exception):
    """The model's load failed while the request waited for it (HTTP 500); the next request tries again."""


@dataclass
class PoolSettings:
    memory: int | None = None  # bytes the loaded models may take (None: no limit)
    idle_unload: float | None = None  # seconds unused after which a model is unloaded (None: never)
    load_wait: float = 60.0  # seconds a request waits for its model
    drain_timeout: float = 30.0  # an explicit unload's wait for the model's open requests


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: str = UNLOADED
    served: ServedModel | None = None
    users: int = 0  # leases held
    waiters: int = 0  # requests waiting for it to load
    last_used: float = 0.0  # time.monotonic() of the last lease taken or given back
    weight_bytes: int = 0  # the estimate, then what its child reported
    child: object | None = None  # the CoreProcess while loading (killed to cancel)
    cancelled: bool = False
    load_started: float = 0.0
    load_seconds: float | None = None  # the last load's
    unload_seconds: float | None = None
    error: str | None = None  # why the last load failed
    failed_at: float = -1.0
    metrics: EngineMetrics | None = None  # the engine's series of its last load (kept after an unload)

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.spec.kv_bytes


class Lease:
    """A request's hold on a loaded model, given back once (`release`)."""

    def __init__(self, pool: ModelPool, entry: ModelEntry) -> None:
        self._pool, self.entry = pool, entry
        self.model: ServedModel = entry.served  # type: ignore[assignment]
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool._release(self.entry)


class ModelPool:
    def __init__(
        self, specs: Sequence[ModelSpec], settings: PoolSettings, serve: ServeSettings, front: FrontDoor
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("models: two models have the same name")
        for spec in specs:
            if settings.memory is not None and spec.memory_bytes > settings.memory:
                raise ValueError(
                    f"memory: {spec.name} alone needs about {spec.memory_bytes / 2**30:.2f} GiB (weights "
                    f"{spec.weight_bytes / 2**30:.2f} + KV {spec.kv_bytes / 2**30:.2f}), more than the "
                    f"{settings.memory / 2**30:.2f} GiB given; lower its kv_cache_memory or raise --memory"
                )
        self.entries = {s.name: ModelEntry(s, weight_bytes=s.weight_bytes) for s in specs}
        self.settings, self.serve, self.front = settings, serve, front
        self.metrics = PoolMetrics(names, settings.memory)
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle_task: asyncio.Task[None] | None = None
        self._closing = False
        self.traces: dict[str, TraceRecorder] = {}  # --record-trace: each model's recorder (multi_app's)

    # -- the server's side ---------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        if name not in self.entries:
            raise ModelNotFound(f"The model '{name}' does not exist; this server serves {', '.join(self.entries)}.")
        return self.entries[name]

    async def acquire(self, name: str) -> Lease:
        """A lease on the loaded model `name`, loading it first if need be (see the module docstring)."""
        entry = self.entry(name)
        loop = asyncio.get_running_loop()
        began, deadline = time.monotonic(), loop.time() + self.settings.load_wait
        entry.waiters += 1
        try:
            while True:
                self._reap_if_dead(entry)
                if entry.state == LOADED:
                    entry.users += 1
                    entry.last_used = time.monotonic()
                    return Lease(self, entry)
                if entry.failed_at >= began:
                    raise ModelLoadFailed(f"The model '{name}' failed to load: {entry.error}")
                if entry.state == UNLOADED and not self._closing:
                    self._make_room_and_load(entry)
                if entry.state != LOADED and not await self._changes(deadline - loop.time()):
                    self.metrics.wait_timed_out(name)
                    raise ModelNotReady(self._not_ready(entry), self._retry_after(entry))
        finally:
            entry.waiters -= 1

    async def load(self, name: str) -> ModelEntry:
        """Load `name` (POST /v1/models/{name}/load): as a request would, but holding nothing after."""
        (await self.acquire(name)).release()
        return self.entry(name)

    async def unload(self, name: str) -> ModelEntry:
        """Unload `name` now (POST /v1/models/{name}/unload): a load in progress is cancelled; open
        requests get up to `drain_timeout` to finish, then are aborted."""
        entry = self.entry(name)
        if entry.state == LOADING:
            self._cancel_load(entry)
        elif entry.state == LOADED:
            self._start_unload(entry, "request", self.settings.drain_timeout)
        while entry.state in (LOADING, UNLOADING):
            await self._changes(None)
        return entry

    def _release(self, entry: ModelEntry) -> None:
        entry.users -= 1
        entry.last_used = time.monotonic()
        self._notify()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the idle watch (call on the event loop that serves)."""
        self._idle_task = asyncio.create_task(self._watch_idle())

    async def close(self) -> None:
        """Stop every model: loads cancelled, engines stopped, children gone."""
        self._closing = True
        if self._idle_task is not None:
            self._idle_task.cancel()
        for entry in self.entries.values():
            if entry.state == LOADING:
                self._cancel_load(entry)
            elif entry.state == LOADED:
                self._start_unload(entry, "shutdown", 0.0)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def begin_drain(self) -> None:
        """No new requests: every loaded model's engine refuses them (the drain on SIGTERM)."""
        self._closing = True
        for entry in self.entries.values():
            if entry.served is not None:
                entry.served.engine.begin_drain()

    def request_stop(self) -> None:
        for entry in self.entries.values():
            if entry.served is not None:
                entry.served.engine.request_stop()

    @property
    def accepting(self) -> bool:
        return not self._closing

    @property
    def num_open(self) -> int:
        return sum(e.served.engine.num_open for e in self.entries.values() if e.served is not None)

    @property
    def used_bytes(self) -> int:
        return sum(e.memory_bytes for e in self.entries.values() if e.state != UNLOADED)

    # -- loading and unloading -------------------------------------------------------------------------

    def _make_room_and_load(self, entry: ModelEntry) -> None:
        """Start `entry`'s load if its memory fits, else unload the least recently used idle models
        until it will (the load then starts on a later pass, once their processes have exited)."""
        budget, need, used = self.settings.memory, entry.memory_bytes, self.used_bytes
        if budget is None or used + need <= budget:
            self._start_load(entry)
            return
        freeing = sum(e.memory_bytes for e in self.entries.values() if e.state == UNLOADING)
        idle = [e for e in self.entries.values() if e.state == LOADED and e.users == 0 and e.waiters == 0]
        for victim in sorted(idle, key=lambda e: e.last_used):
            if used - freeing + need <= budget:
                break
            freeing += victim.memory_bytes
            self._start_unload(victim, "memory", 0.0)

    def _start_load(self, entry: ModelEntry) -> None:
        entry.state, entry.cancelled, entry.error = LOADING, False, None
        entry.load_started = time.monotonic()
        self.metrics.set_state(entry.spec.name, LOADING, entry.memory_bytes)
        logger.info("model %s: loading (about %.0f MiB)", entry.spec.name, entry.memory_bytes / 2**20)
        self._spawn_task(self._load(entry))

    async def _load(self, entry: ModelEntry) -> None:
        name = entry.spec.name
        try:
            child = spawn_core(entry.spec.config, name)
            entry.child = child
            served = await asyncio.to_thread(load_model, entry.spec, child, self.serve, self.front)
        except Exception as e:
            entry.child = None
            self._loaded_not(entry, None if entry.cancelled else str(e))
            return
        entry.child = None
        if entry.cancelled:  # (unloaded or shut down while its front end was built)
            await asyncio.to_thread(served.engine.stop, STOP_WAIT_S)
            self._loaded_not(entry, None)
            return
        served.engine.start()
        if name in self.traces:
            served.engine.on_finished = self.traces[name].record
        entry.metrics = served.metrics
        seconds = time.monotonic() - entry.load_started
        entry.served, entry.state, entry.load_seconds = served, LOADED, seconds
        entry.last_used = time.monotonic()
        weights = served.engine.stats().weight_bytes
        entry.weight_bytes = weights or entry.weight_bytes
        self.metrics.loaded(name, seconds, entry.memory_bytes)
        logger.info("model %s: loaded in %.2f s (process %d)", name, seconds, served.pid)
        self._notify()

    def _loaded_not(self, entry: ModelEntry, error: str | None) -> None:
        """A load that ended without a model: failed (`error`) or cancelled."""
        entry.state = UNLOADED
        if error is not None:
            entry.error, entry.failed_at = error, time.monotonic()
            self.metrics.load_failed(entry.spec.name)
            logger.error("model %s: %s", entry.spec.name, error)
        self.metrics.set_state(entry.spec.name, UNLOADED, 0)
        self._notify()

    def _cancel_load(self, entry: ModelEntry) -> None:
        entry.cancelled = True
        child = entry.child
        if child is not None:
            kill = child.kill  # type: ignore[attr-defined]
            self._spawn_task(asyncio.to_thread(kill))  # (its load then fails: the wait ends)

    def _start_unload(self, entry: ModelEntry, reason: str, drain: float) -> None:
        entry.state = UNLOADING
        self.metrics.set_state(entry.spec.name, UNLOADING, entry.memory_bytes)
        self._spawn_task(self._unload(entry, reason, drain))

    async def _unload(self, entry: ModelEntry, reason: str, drain: float) -> None:
        served = entry.served
        assert served is not None
        started = time.monotonic()
        served.engine.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain
        while entry.users and loop.time() < deadline:
            await self._changes(deadline - loop.time())
        await asyncio.to_thread(served.engine.stop, STOP_WAIT_S)
        entry.served, entry.state = None, UNLOADED
        forget_endpoints()
        entry.unload_seconds = time.monotonic() - started
        self.metrics.unloaded(entry.spec.name, reason, entry.unload_seconds)
        logger.info("model %s: unloaded (%s) in %.2f s", entry.spec.name, reason, entry.unload_seconds)
        self._notify()

    def _reap_if_dead(self, entry: ModelEntry) -> None:
        """A loaded model whose engine no longer runs (its child died) is unloaded, to load again."""
        if entry.state == LOADED and entry.served is not None and not entry.served.engine.healthy:
            logger.error("model %s: its engine process has ended; unloading it", entry.spec.name)
            self._start_unload(entry, "failed", 0.0)

    async def _watch_idle(self) -> None:
        idle = self.settings.idle_unload
        tick = 1.0 if idle is None else max(0.05, min(1.0, idle / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for entry in self.entries.values():
                self._reap_if_dead(entry)
                quiet = entry.state == LOADED and entry.users == 0 and entry.waiters == 0
                if quiet and idle is not None and now - entry.last_used >= idle:
                    self._start_unload(entry, "idle", 0.0)

    # -- helpers -------------------------------------------------------------------------------------

    def _spawn_task(self, work: object) -> None:
        task = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _changes(self, timeout: float | None) -> bool:
        """Wait for the pool's state to change (False: `timeout` seconds passed first)."""
        if timeout is not None and timeout <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        return False

    def _not_ready(self, entry: ModelEntry) -> str:
        name, wait = entry.spec.name, self.settings.load_wait
        if entry.state == LOADING:
            return f"the model '{name}' is still loading after {wait:.0f} s; retry shortly"
        return f"no memory for the model '{name}' within {wait:.0f} s: the loaded models are all in use"

    def _retry_after(self, entry: ModelEntry) -> int:
        """Seconds until the model is likely loaded: its last load time less the time loading so far."""
        if entry.state == LOADING and entry.load_seconds is not None:
            return max(1, round(entry.load_seconds - (time.monotonic() - entry.load_started)))
        return DEFAULT_RETRY_S
