"""The doctor's replays of a trace through the simulator: one setting each, each run once.

`Replays` holds a workload and the current settings (its KV cache in bytes, the cost model); a
replay is asked for by the settings it changes (and, where a question needs them, a cache of a given
number of blocks, another cost model, Poisson arrivals at a rate), runs through `bench.offline.
run_offline` on a `simulator.SimulatedEngine` (fast-forward on), and is kept: every question that asks
for the same setting gets the same summary, and a setting equal to the current one is the current
replay. A capacity search's replay may also be given a `SloWatch` (slo_watch.py): it then stops as
soon as its SLOs are missed whatever its remaining requests do, and its summary says only that (it is
kept apart from the whole replay of the same setting, which a later question may still ask for).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.workloads import Workload, send_times
from tokenmill.config import EngineConfig
from tokenmill.doctor.model_fit import kv_bytes_per_token
from tokenmill.doctor.scale import DecodeOnlyCost
from tokenmill.doctor.simulator import SimulatedEngine
from tokenmill.doctor.slo_watch import SloWatch
from tokenmill.doctor.step_cost import CostModel, StepCost

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

STOPPED = "not run: the SLOs were already missed (the replay stopped early)"


class Replays:
    """The trace through the simulator at the current settings with some changed; each replay once."""

    def __init__(
        self,
        config: EngineConfig,
        kv_memory: int,
        kv_token_bytes: float,
        max_model_len: int,
        cost: StepCost,
        workload: Workload,
        request_rate: float | None,
    ) -> None:
        self.config = config
        self.kv_memory = kv_memory
        self.kv_token_bytes = kv_token_bytes
        self.max_model_len = max_model_len
        self.cost = cost
        self.workload = workload
        self.request_rate = request_rate
        self._done: dict[str, tuple[dict[str, Any], SimulatedEngine]] = {}
        self.records: dict[str, list[RequestRecord]] = {}  # by the same key
        self.decode_only = DecodeOnlyCost(cost)
        self.progress: Callable[[str], None] | None = None  # told of each replay as it ends
        self.count = 0  # replays run (stopped ones included)

    @classmethod
    def of(
        cls,
        engine: LLMEngine,
        cost: StepCost,
        workload: Workload,
        request_rate: float | None,
        progress: Callable[[str], None] | None = None,
    ) -> Replays:
        """The replays of `workload` on the KV cache and settings of `engine` (`progress` told of each)."""
        config = engine.config
        token_bytes = kv_bytes_per_token(engine.model_config, kv_value_bytes(engine))
        kv_memory = int(engine.core.num_blocks * config.block_size * token_bytes)
        replays = cls(config, kv_memory, token_bytes, engine.max_model_len, cost, workload, request_rate)
        replays.progress = progress
        return replays

    def engine(self, settings: dict[str, Any], num_blocks: int | None = None) -> SimulatedEngine:
        return self.run(settings, num_blocks)[1]

    def __call__(self, settings: dict[str, Any]) -> dict[str, Any]:
        return self.run(settings)[0]

    def run(
        self,
        settings: dict[str, Any],
        num_blocks: int | None = None,
        cost: CostModel | None = None,
        request_rate: float | None = None,
        watch: SloWatch | None = None,
    ) -> tuple[dict[str, Any], SimulatedEngine]:
        """The replay with `settings` changed (and a cache of `num_blocks`, another cost model, Poisson
        arrivals at `request_rate` in place of the trace's); with `watch`, stopped once its SLOs are
        missed for sure (the summary then has `stopped` and every request not finished counted failed)."""
        settings = self._changed(settings)
        key = self._key(settings, num_blocks, cost, request_rate)
        if key in self._done:
            return self._done[key]
        watched = self._key(settings, num_blocks, cost, request_rate, watch) if watch is not None else key
        if watched not in self._done:
            done = self._replay(settings, num_blocks, cost, request_rate, watch)
            self._done[key if not done[0].get("stopped") else watched] = done
        return self._done[key] if key in self._done else self._done[watched]

    def _replay(
        self,
        settings: dict[str, Any],
        num_blocks: int | None,
        cost: CostModel | None,
        request_rate: float | None,
        watch: SloWatch | None,
    ) -> tuple[dict[str, Any], SimulatedEngine]:
        config = dataclasses.replace(self.config, **settings)
        memory = settings.get("kv_cache_memory", self.kv_memory)
        blocks = num_blocks or max(1, int(memory // (config.block_size * self.kv_token_bytes)))
        current = not settings and num_blocks is None and cost is None and request_rate is None and watch is None
        # (the current replay's KV manager notes whether an ample cache would replay it alike: diagnose's peak)
        sim = SimulatedEngine(config, blocks, self.max_model_len, cost or self.cost, watch_kv=current)
        start = time.perf_counter()
        workload = self.workload
        if request_rate is not None:  # the trace's requests, at this rate
            requests = [dataclasses.replace(r, arrival_s=None) for r in workload.requests]
            workload = Workload(workload.spec, requests)
        rate = request_rate if request_rate is not None else self.request_rate
        due = send_times(workload.requests, rate, workload.spec.seed)  # (as run_offline will)
        sim.arrivals = sorted(t for t in due if t is not None)  # the simulator may fast-forward
        until = watch.watch(len(workload.requests)) if watch is not None else None
        run = run_offline(sim, workload, "doctor", request_rate=rate, clock=sim.clock, sleep=sim.sleep, until=until)
        summary = summarize(run.records, max(run.duration_s, 1e-9))
        summary["kv_live_share"] = run.extras.get("kv_live_share")
        summary["preemptions"] = run.extras.get("preemptions")
        total = len(workload.requests)
        self.count += 1
        said = f"{total} requests"
        if run.extras.get("stopped"):
            assert watch is not None
            summary["stopped"] = True
            summary["failed"] = total - summary["completed"]
            summary["errors"] = {STOPPED: summary["failed"]}
            said = f"stopped after {summary['completed']} of {total} requests ({watch.describe()} missed whatever "
            said += "the rest do)"
        if self.progress is not None:
            label = _label(settings, num_blocks, cost, request_rate)
            self.progress(f"replay {self.count} ({label}): {said} in {time.perf_counter() - start:.1f} s")
        self.records[self._key(settings, num_blocks, cost, request_rate, watch if summary.get("stopped") else None)] = (
            run.records
        )
        return summary, sim

    def records_of(self, settings: dict[str, Any]) -> list[RequestRecord]:
        self.run(settings)
        return self.records[self._key(self._changed(settings), None, None, None)]

    def _changed(self, settings: dict[str, Any]) -> dict[str, Any]:
        """`settings` less those the current settings have already (the same replay, run once)."""
        return {k: v for k, v in settings.items() if not hasattr(self.config, k) or getattr(self.config, k) != v}

    @staticmethod
    def _key(
        settings: dict[str, Any],
        num_blocks: int | None,
        cost: CostModel | None,
        rate: float | None,
        watch: SloWatch | None = None,
    ) -> str:
        parts: list[Any] = [sorted(settings.items()), num_blocks, id(cost), rate]
        return json.dumps(parts + ([dataclasses.astuple(watch)] if watch is not None else []), default=str)


def _label(settings: dict[str, Any], num_blocks: int | None, cost: CostModel | None, rate: float | None) -> str:
    """A replay in words, for a progress line."""
    parts = [f"{k}={v}" for k, v in settings.items()]
    parts += [f"{num_blocks} blocks"] if num_blocks else []
    parts += ["decode-only steps"] if cost is not None else []
    parts += [f"{rate:g} requests/s"] if rate is not None else []
    return ", ".join(parts) or "current settings"


def kv_value_bytes(engine: LLMEngine) -> float:
    """Bytes a K or V value takes in `engine`'s cache (int8: its per-token scales left out)."""
    return 1.0 if engine.config.kv_cache_dtype == "int8" else float(engine.core.worker.kv_dtype.itemsize)
