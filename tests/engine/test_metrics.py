"""Engine metrics: counters from cumulative totals, latency histograms, the periodic log line."""

from __future__ import annotations

from tokenmill.engine.metrics import EngineMetrics
from tokenmill.outputs import EngineStats, RequestMetrics


def gauges(
    running: int,
    waiting: int,
    usage: float,
    preemptions: int,
    prompt: int,
    generated: int,
    prefix_cache_queries_total: int = 0,
    prefix_cache_hits_total: int = 0,
) -> EngineStats:
    """Engine stats with `usage` of 8 KV blocks in use."""
    free = round(8 * (1 - usage))
    return EngineStats(
        running,
        waiting,
        8,
        free,
        preemptions,
        0,
        prompt,
        generated,
        prefix_cache_queries_total,
        prefix_cache_hits_total,
        0,
        0,
        128,
    )


def sample(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def test_counters_follow_totals_and_histograms_observe_a_request():
    m = EngineMetrics("tiny")
    m.observe_step(gauges(2, 3, 0.25, 1, 100, 10))
    m.observe_step(gauges(1, 0, 0.5, 1, 150, 30))
    m.observe_finished(RequestMetrics(10.0, 10.5, 11.0, 13.0), num_output_tokens=5, finish_reason="stop")
    text = m.render().decode()
    assert sample(text, "tokenmill:prompt_tokens_total") == 150
    assert sample(text, "tokenmill:generation_tokens_total") == 30
    assert sample(text, "tokenmill:num_preemptions_total") == 1
    assert sample(text, "tokenmill:num_requests_running") == 1
    assert sample(text, "tokenmill:kv_cache_usage_perc") == 0.5
    assert sample(text, "tokenmill:time_to_first_token_seconds_sum") == 1.0
    assert sample(text, "tokenmill:request_queue_time_seconds_sum") == 0.5
    assert sample(text, "tokenmill:request_prefill_time_seconds_sum") == 0.5
    assert sample(text, "tokenmill:request_decode_time_seconds_sum") == 2.0
    assert sample(text, "tokenmill:time_per_output_token_seconds_sum") == 0.5  # 2 s over 4 tokens after the first
    assert sample(text, "tokenmill:e2e_request_latency_seconds_sum") == 3.0
    assert 'tokenmill:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_log_line_reports_rates_and_load():
    clock = FakeClock(10.0)
    m = EngineMetrics("tiny", clock=clock)
    m.log_line()  # marks the start
    m.observe_step(gauges(4, 2, 0.125, 3, 1000, 200, prefix_cache_queries_total=800, prefix_cache_hits_total=200))
    clock.now = 12.0
    line = m.log_line()
    assert "Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Preemptions: 3" in line
    assert "Prefix cache hit rate: 25.0%" in line
    # 1000 prompt and 200 generated tokens over 2.0 s
    assert "Avg prompt throughput: 500.0 tokens/s, Avg generation throughput: 100.0 tokens/s" in line
    m.observe_step(gauges(1, 0, 0.0, 3, 1600, 250, prefix_cache_queries_total=800, prefix_cache_hits_total=200))
    clock.now = 14.5
    # only what came since the previous line: 600 and 50 tokens over 2.5 s
    assert "Avg prompt throughput: 240.0 tokens/s, Avg generation throughput: 20.0 tokens/s" in m.log_line()


def test_log_line_first_rates_run_from_construction():
    clock = FakeClock(100.0)
    m = EngineMetrics("tiny", clock=clock)
    m.observe_step(gauges(1, 0, 0.5, 0, 300, 40))
    clock.now = 104.0
    assert "Avg prompt throughput: 75.0 tokens/s, Avg generation throughput: 10.0 tokens/s" in m.log_line()
