"""The several-model server's Prometheus series, and /metrics over every model's.

Each model's engine keeps its own `EngineMetrics` (one registry, every series labelled `model_name`),
made anew at each load; the pool's own series (`PoolMetrics`) say which models are in which state,
their memory, and how their loads and unloads went. `/metrics` merges the registries: series of the
same name from several registries become one family with each model's samples (Prometheus' text
format allows one HELP/TYPE block per name).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from tokenmill.engine.metrics import LATENCY_BUCKETS, PREFIX

STATES = ("unloaded", "loading", "loaded", "unloading")
UNLOAD_REASONS = ("idle", "memory", "request", "failed", "shutdown")


class PoolMetrics:
    def __init__(self, names: Sequence[str], budget: int | None) -> None:
        r = self.registry = CollectorRegistry()
        self.state = Gauge(
            PREFIX + "model_state", "1 for the state each model is in (unloaded, loading, loaded, unloading).",
            ["model_name", "state"], registry=r,
        )  # fmt: skip
        self.memory = Gauge(
            PREFIX + "model_memory_bytes",
            "Memory a model takes while loading, loaded or unloading (weights + KV cache; 0 when unloaded).",
            ["model_name"], registry=r,
        )  # fmt: skip
        budget_gauge = Gauge(PREFIX + "models_memory_budget_bytes", "The --memory budget (0: none).", registry=r)
        budget_gauge.set(budget or 0)
        self.loads = Counter(PREFIX + "model_loads", "Loads that finished.", ["model_name"], registry=r)
        self.load_failures = Counter(PREFIX + "model_load_failures", "Loads that failed.", ["model_name"], registry=r)
        self.unloads = Counter(
            PREFIX + "model_unloads", "Unloads, by reason (idle, memory, request, failed, shutdown).",
            ["model_name", "reason"], registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            PREFIX + "model_load_seconds", "Time to load a model (process start to serving).", ["model_name"],
            registry=r, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.unload_seconds = Histogram(
            PREFIX + "model_unload_seconds", "Time to unload a model (drain and process exit).", ["model_name"],
            registry=r, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.wait_timeouts = Counter(
            PREFIX + "model_wait_timeouts", "Requests answered 503 while their model loaded (or waited for memory).",
            ["model_name"], registry=r,
        )  # fmt: skip
        for name in names:
            self.set_state(name, "unloaded", 0)
            self.loads.labels(name)
            self.load_failures.labels(name)
            self.wait_timeouts.labels(name)

    def set_state(self, name: str, state: str, memory: int) -> None:
        for s in STATES:
            self.state.labels(name, s).set(1 if s == state else 0)
        self.memory.labels(name).set(memory)

    def loaded(self, name: str, seconds: float, memory: int) -> None:
        self.set_state(name, "loaded", memory)
        self.loads.labels(name).inc()
        self.load_seconds.labels(name).observe(seconds)

    def load_failed(self, name: str) -> None:
        self.load_failures.labels(name).inc()

    def unloaded(self, name: str, reason: str, seconds: float) -> None:
        self.set_state(name, "unloaded", 0)
        self.unloads.labels(name, reason).inc()
        self.unload_seconds.labels(name).observe(seconds)

    def wait_timed_out(self, name: str) -> None:
        self.wait_timeouts.labels(name).inc()


class Merged:
    """Registries read as one (`collect`, as generate_latest asks): families of one name joined."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


def render(registries: Iterable[CollectorRegistry]) -> bytes:
    """The Prometheus text of every registry, merged."""
    return generate_latest(Merged(registries))  # type: ignore[arg-type]
