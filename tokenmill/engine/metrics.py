"""Engine metrics: Prometheus series named as vLLM's (prefix `tokenmill:`), and the periodic log line.

Owns one `CollectorRegistry` per server (no process-global registry), the per-request latency
histograms (TTFT, inter-token latency, TPOT, end-to-end, queue, prefill, decode), the engine gauges
and counters (running, waiting, KV usage, preemptions, prompt and generation tokens, successes by
finish reason), and a vLLM-like summary line of throughput and load. With data-parallel replicas,
the series above are the totals over the replicas, and `replica_*` series (labelled `replica`) hold
each one's load, cache use, prefix hits, routing and whether it is up. Faults: `engine_step_failures`
(steps whose requests failed, the engine going on), `engine_request_faults` (requests failed with an
error) and `engine_restarts` (cores the watchdog restarted).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.outputs import EngineStats, RequestMetrics

PREFIX = "tokenmill:"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


FAULT_COUNTERS = (
    ("engine_step_failures", "Engine steps that failed (their requests failed with an error; the engine went on)."),
    (
        "engine_request_faults",
        "Requests the engine failed with an error (their own processing, or a step they were in).",
    ),
    ("engine_restarts", "Engine cores the watchdog restarted after their loop ended unasked."),
)


class EngineMetrics:
    def __init__(self, model_name: str, clock: Callable[[], float] = time.monotonic, num_replicas: int = 1) -> None:
        """`clock` times the log line's rates (seconds; injectable so a test controls the interval);
        `num_replicas`: data-parallel engine cores whose steps `observe_step` gets."""
        self._clock = clock
        self.registry = CollectorRegistry()
        self._define_series(self.registry)
        self.model_name = model_name
        self._last = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # the totals
        self._zero = self._last
        self._by_replica: dict[int, EngineStats] = {}  # each live replica's latest stats
        self._retired = self._zero  # the running totals of replicas lost since the start
        self._replica_series = _ReplicaSeries(self.registry, model_name) if num_replicas > 1 else None
        self._log_mark = (self._clock(), self._last)
        self._label_step_series(model_name)

    def _define_series(self, r: CollectorRegistry) -> None:
        """Every series of the engine, in registry `r` (labelled by model name)."""
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first.", TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", labels, registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Preemptions.", labels, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens computed.", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=r)
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
        )
        self.spec_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Speculative verification chunks (a request's drafts a step).", labels,
            registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", labels, registry=r
        )
        self.spec_accepted = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            [*labels, "position"], registry=r,
        )  # fmt: skip
        parts = [  # the counters of the engine's optional parts: KV transfer, structured output
            ("kv_transfer_sent_bytes", "KV bytes copied out of finished prefills (disaggregated serving)."),
            ("kv_transfer_received_bytes", "KV bytes received and written into the cache (disaggregated serving)."),
            ("kv_transfer_sent", "Prefills whose KV was copied out for a decode engine."),
            ("kv_transfer_received", "Requests admitted with KV received from a prefill engine."),
            ("kv_transfer_recomputed", "Handed-over requests whose KV did not arrive: their prompt was recomputed."),
            ("kv_transfer_seconds", "Time spent copying KV out of and into the cache."),
            ("structured_compiles", "Structured-output grammars compiled by the engine."),
            ("structured_compile_seconds", "Time compiling structured-output grammars."),
            ("structured_cache_hits", "Structured-output requests whose grammar was compiled already."),
            ("structured_masks", "Grammar masks computed and applied (one per constrained row per step)."),
            ("structured_mask_seconds", "Time computing and applying grammar masks."),
        ]
        self.part_counters = {name: Counter(PREFIX + name, doc, labels, registry=r) for name, doc in parts}
        self.success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.step_failures, self.request_faults, self.restarts = (
            Counter(PREFIX + name, doc, labels, registry=r) for name, doc in FAULT_COUNTERS
        )

    def _label_step_series(self, m: str) -> None:
        """The series every step updates, labelled once: a `labels()` lookup per series per step cost
        more than the rest of a step's bookkeeping on the event loop."""
        self._gauges = [(self.running.labels(m), "running"), (self.waiting.labels(m), "waiting")]
        self._gauges.append((self.kv_usage.labels(m), "kv_cache_usage"))
        self._counters = [
            (self.preemptions.labels(m), "preemptions"),
            (self.prompt_tokens.labels(m), "prompt_tokens"),
            (self.generation_tokens.labels(m), "generated_tokens"),
            (self.prefix_queries.labels(m), "prefix_cache_queries"),
            (self.prefix_hits.labels(m), "prefix_cache_hits"),
            (self.spec_drafts.labels(m), "spec_decode_num_drafts"),
            (self.spec_draft_tokens.labels(m), "spec_decode_num_draft_tokens"),
            (self.spec_accepted.labels(m), "spec_decode_num_accepted_tokens"),
        ]
        self._counters += [(counter.labels(m), name) for name, counter in self.part_counters.items()]
        self._counters.append((self.step_failures.labels(m), "step_failures"))
        self._itl = self.itl.labels(m)

    def observe_step(self, stats: EngineStats, replica: int = 0) -> None:
        """A replica's stats after one of its steps: the totals' series and the replica's own."""
        before = self._by_replica.get(replica, self._zero)
        self._by_replica[replica] = stats
        if self._replica_series is not None:
            self._replica_series.observe(replica, stats, before)
        if len(self._by_replica) == 1 and self._retired is self._zero:
            g = stats
        else:  # the totals over the replicas (their running totals counting those lost)
            g = sum_stats([self._retired, *self._by_replica.values()])
        last = self._last
        for gauge, name in self._gauges:
            value = getattr(g, name)
            if value != getattr(last, name):
                gauge.set(value)
        for counter, name in self._counters:
            delta = getattr(g, name) - getattr(last, name)
            if delta:
                counter.inc(delta)
        done = last.spec_decode_num_accepted_tokens_per_pos
        for pos, count in enumerate(g.spec_decode_num_accepted_tokens_per_pos):
            delta = count - (done[pos] if pos < len(done) else 0)
            if delta:
                self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(delta)
        self._last = g

    def replica_lost(self, replica: int) -> None:
        """A replica is gone: its running totals stay counted, its load no longer is; one that
        rejoins in its place starts from zero."""
        last = self._by_replica.pop(replica, None)
        if last is not None:
            self._retired = sum_stats([self._retired, _totals(last)])
        if self._replica_series is not None:
            self._replica_series.up.labels(self.model_name, str(replica)).set(0)

    def replica_restarted(self, replica: int, start: EngineStats) -> None:
        """A replica lost earlier rejoined (the watchdog's restart), its totals starting at `start`: a
        core kept from before (a restart in place) brings the totals counted when it was lost, which
        are then not counted twice; a new one brings zeros."""
        self.restarts.labels(self.model_name).inc()
        self._retired = sum_stats([self._retired, _negated(_totals(start))])

    def observe_request_fault(self) -> None:
        self.request_faults.labels(self.model_name).inc()

    def replica_up(self, replica: int) -> None:
        if self._replica_series is not None:
            self._replica_series.up.labels(self.model_name, str(replica)).set(1)

    def observe_routed(self, replica: int, by_prefix: bool) -> None:
        if self._replica_series is not None:
            self._replica_series.routed.labels(self.model_name, str(replica), "prefix" if by_prefix else "load").inc()

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, t: RequestMetrics, num_output_tokens: int, finish_reason: str) -> None:
        m = self.model_name
        self.success.labels(m, finish_reason).inc()
        if t.finished_time is None:
            return
        self.e2e.labels(m).observe(t.finished_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            self.queue.labels(m).observe(t.first_scheduled_time - t.arrival_time)
        if t.first_token_time is None:
            return
        self.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
        self.decode.labels(m).observe(t.finished_time - t.first_token_time)
        if t.first_scheduled_time is not None:
            self.prefill.labels(m).observe(t.first_token_time - t.first_scheduled_time)
        if num_output_tokens > 1:
            self.tpot.labels(m).observe((t.finished_time - t.first_token_time) / (num_output_tokens - 1))

    def observe_aborted(self) -> None:
        """A request aborted before it finished (its client went away, or the server shut down)."""
        self.success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> str:
        """Throughput since the previous call and the current load, like vLLM's periodic line."""
        now, g = self._clock(), self._last
        then, before = self._log_mark
        dt = max(now - then, 1e-9)
        self._log_mark = (now, g)
        return (
            f"Avg prompt throughput: {(g.prompt_tokens - before.prompt_tokens) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(g.generated_tokens - before.generated_tokens) / dt:.1f} "
            f"tokens/s, Running: {g.running} reqs, Waiting: {g.waiting} reqs, "
            f"KV cache usage: {g.kv_cache_usage * 100:.1f}%, Preemptions: {g.preemptions}, "
            f"Prefix cache hit rate: {g.prefix_cache_hits / max(g.prefix_cache_queries, 1) * 100:.1f}%"
            + (
                f", Spec decode: acceptance rate {g.spec_decode_acceptance_rate * 100:.1f}%, "
                f"mean accepted length {g.spec_decode_mean_accepted_length:.2f}"
                if g.spec_decode_num_drafts
                else ""
            )
        )


class _ReplicaSeries:
    """The per-replica series of a data-parallel server."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "replica"]
        self.model_name = model_name
        self.up = Gauge(PREFIX + "replica_up", "1 while the engine replica runs, 0 once lost.", labels, registry=r)
        self.running = Gauge(PREFIX + "replica_num_requests_running", "Requests running.", labels, registry=r)
        self.waiting = Gauge(PREFIX + "replica_num_requests_waiting", "Requests waiting.", labels, registry=r)
        self.kv_usage = Gauge(PREFIX + "replica_kv_cache_usage_perc", "KV blocks in use (0-1).", labels, registry=r)
        self.queries = Counter(
            PREFIX + "replica_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.hits = Counter(PREFIX + "replica_prefix_cache_hits", "Prompt tokens found.", labels, registry=r)
        self.routed = Counter(
            PREFIX + "replica_requests_routed", "Requests sent to the replica, by why (prefix or load).",
            [*labels, "by"], registry=r,
        )  # fmt: skip

    def observe(self, replica: int, g: EngineStats, before: EngineStats) -> None:
        m, i = self.model_name, str(replica)
        self.running.labels(m, i).set(g.running)
        self.waiting.labels(m, i).set(g.waiting)
        self.kv_usage.labels(m, i).set(g.kv_cache_usage)
        for counter, name in ((self.queries, "prefix_cache_queries"), (self.hits, "prefix_cache_hits")):
            delta = getattr(g, name) - getattr(before, name)
            if delta > 0:
                counter.labels(m, i).inc(delta)


GAUGES = ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "weight_bytes", "kv_tokens")


def _totals(stats: EngineStats) -> EngineStats:
    """The running totals alone (gauges 0): what a lost replica leaves counted."""
    return dataclasses.replace(stats, **dict.fromkeys(GAUGES, 0))


def _negated(stats: EngineStats) -> EngineStats:
    out: dict[str, object] = {}
    for f in dataclasses.fields(EngineStats):
        value = getattr(stats, f.name)
        out[f.name] = tuple(-v for v in value) if isinstance(value, tuple) else -value
    return EngineStats(**out)  # type: ignore[arg-type]


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Field by field sums (every field of EngineStats adds up across replicas)."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], tuple):
            width = max(len(v) for v in values)
            out[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            out[f.name] = sum(values)
    return EngineStats(**out)  # type: ignore[arg-type]
