"""Benchmark arithmetic: latency distributions, throughput, goodput and cost from request records.

Definitions (vLLM's, so figures compare across tools):
- TTFT: send -> first token. E2E: send -> last token.
- TPOT: (e2e - ttft) / (output_tokens - 1), per request with at least two tokens.
- ITL: every gap between successive token arrivals, pooled over requests. A streamed chunk that
  carries several tokens counts as one arrival (its gap is one ITL sample), as in vLLM.
- Throughput: completed requests, output tokens, prompt + output tokens, each per second of the
  run's duration (first send -> last response).
- Goodput: completed requests per second that met every SLO given (ttft, tpot, e2e, in ms).
- Cost: price per hour x duration / output tokens, per million output tokens.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.bench.records import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2e")
LATENCIES = ("ttft", "tpot", "itl", "e2e")
# Metrics a gain is computed for: larger is better, or smaller is better (latencies, costs, overheads).
# Counts (completed, tokens, duration) are reported but not ranked.
LOWER_IS_BETTER = (*LATENCIES, "cost_per_million_output_tokens", "full_decode_overhead_ms", "full_decode_step_ms")
HIGHER_IS_BETTER = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "goodput_share",
    "cached_share",
    "kv_live_share",
)


def parse_slos(text: str | None) -> dict[str, float]:
    """ "ttft:500,tpot:50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not text:
        return {}
    slos: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput: {part!r} is not KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {value!r} in {part!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput: the {key} SLO must be above 0 ms, got {value}")
        slos[key] = ms
    return slos


def distribution(values_s: Sequence[float]) -> dict[str, float] | None:
    """Mean, median, p90, p99, min and max, in milliseconds; None when there is nothing to describe."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean": float(ms.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(ms.min()),
        "max": float(ms.max()),
    }


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request met every SLO given; a missing measure (TPOT of a 1-token reply) passes."""
    if not record.ok:
        return False
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    return all(measured[k] is None or measured[k] * 1e3 <= limit for k, limit in slos.items())  # type: ignore[operator]


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    cost_per_hour: float | None = None,
) -> dict[str, Any]:
    """Every metric of one run, as plain JSON-ready values (latencies in ms)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    cached_of = sum(r.prompt_tokens or 0 for r in done if r.cached_tokens is not None)
    if not duration_s > 0:
        raise ValueError(f"duration_s: a run must last a positive time, got {duration_s}")
    per_s = 1.0 / duration_s
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(cached) if cached else None,
        "cached_share": sum(cached) / cached_of if cached and cached_of else None,
        "request_throughput": len(done) * per_s,
        "output_throughput": output * per_s,
        "total_token_throughput": (prompt + output) * per_s,
        "ttft": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl": distribution([gap for r in done for gap in r.itl_s]),
        "e2e": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "errors": _error_counts(failed),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in done)
        summary["slos_ms"] = dict(slos)
        summary["goodput"] = good * per_s
        summary["goodput_share"] = good / len(records) if records else 0.0
    if cost_per_hour is not None:
        hours = duration_s / 3600
        summary["cost_per_hour"] = cost_per_hour
        summary["cost_per_million_output_tokens"] = cost_per_hour * hours / output * 1e6 if output else None
    return summary


def _error_counts(failed: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown error")[:120]
        counts[key] = counts.get(key, 0) + 1
    return counts


def flatten(summary: dict[str, Any], extras: dict[str, Any] | None = None) -> dict[str, float]:
    """Numeric metrics as flat names ("ttft.median", "output_throughput", "kv_live_share")."""
    flat: dict[str, float] = {}
    for source in (summary, extras or {}):
        for key, value in source.items():
            if isinstance(value, dict) and key in LATENCIES:
                flat.update({f"{key}.{stat}": float(v) for stat, v in value.items()})
            elif isinstance(value, int | float) and not isinstance(value, bool):
                flat[key] = float(value)
    return flat


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max of repeats, and the samples themselves."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("spread: no samples")
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "samples": values}


def gain(metric: str, variant: float, base: float) -> float | None:
    """How much better `variant` is than `base` on `metric`: above 1 is better. Throughputs divide
    variant by base, latencies base by variant (so 2.0 means twice the tokens/s or half the time).
    None for metrics that are not ranked (counts) and where the divisor is zero."""
    kind = metric.split(".")[0]
    if kind in HIGHER_IS_BETTER:
        return variant / base if base else None
    if kind in LOWER_IS_BETTER:
        return base / variant if variant else None
    return None
