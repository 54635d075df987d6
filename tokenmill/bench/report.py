"""The terminal report of a result: one column per label (median [min–max] over repeats), then each
label's gain over the base, then the reasons requests failed."""

from __future__ import annotations

from typing import Any

from tokenmill.bench.compare import labels_in_order
from tokenmill.bench.records import BenchResult

ROWS: tuple[tuple[str, str, str], ...] = (
    ("completed requests", "completed", "{:.0f}"),
    ("failed requests", "failed", "{:.0f}"),
    ("duration, s", "duration_s", "{:.2f}"),
    ("request throughput, req/s", "request_throughput", "{:.3f}"),
    ("output tokens/s", "output_throughput", "{:.1f}"),
    ("total tokens/s", "total_token_throughput", "{:.1f}"),
    ("goodput, req/s", "goodput", "{:.3f}"),
    ("requests within the SLOs", "goodput_share", "{:.1%}"),
    ("cost per 1M output tokens, USD", "cost_per_million_output_tokens", "{:.3f}"),
    ("cached prompt tokens", "cached_share", "{:.1%}"),
    *(
        (f"{name.upper()} {stat}, ms", f"{name}.{stat}", "{:.2f}")
        for name in ("ttft", "tpot", "itl", "e2e")
        for stat in ("mean", "median", "p90", "p99")
    ),
    ("KV slots holding live tokens", "kv_live_share", "{:.1%}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("prompt tokens from the prefix cache", "prefix_cache_hit_tokens", "{:.0f}"),
    ("draft tokens accepted (speculative decoding)", "spec_decode_acceptance_rate", "{:.1%}"),
    ("  tokens a verification step yields", "spec_decode_mean_accepted_length", "{:.2f}"),
    ("full decode step, ms", "full_decode_step_ms", "{:.2f}"),
    ("  of which outside the forward, ms", "full_decode_overhead_ms", "{:.2f}"),
)
GAIN_ROWS = (
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
    "goodput",
    "ttft.median",
    "ttft.p99",
    "tpot.median",
    "itl.median",
    "e2e.mean",
    "e2e.median",
)


def _cell(stats: dict[str, Any] | None, fmt: str) -> str:
    if stats is None:
        return "–"
    text = fmt.format(stats["median"])
    if stats["min"] != stats["max"]:
        text += f" [{fmt.format(stats['min'])}–{fmt.format(stats['max'])}]"
    return text


def render(result: BenchResult) -> str:
    labels = labels_in_order(result.runs)
    repeats = max((run.repeat for run in result.runs), default=0) + 1
    w = result.workload
    lines = [
        f"workload {w.get('name')} (seed {w.get('seed')}): {w.get('num_requests')} requests, "
        f"{w.get('prompt_tokens')} prompt tokens, {w.get('max_output_tokens')} output tokens asked; "
        f"{repeats} repeat{'s' if repeats > 1 else ''}" + (", median [min–max]" if repeats > 1 else "")
    ]
    table = [["", *labels]]
    for title, key, fmt in ROWS:
        cells = [_cell(result.aggregate.get(label, {}).get(key), fmt) for label in labels]
        if any(c != "–" for c in cells):
            table.append([title, *cells])
    lines += _format_table(table)
    for name, gains in result.gains.items():
        shown = [(k, gains[k]) for k in GAIN_ROWS if k in gains]
        if shown:
            lines.append(f"gain of {name} (above 1: better; latencies as base ÷ variant):")
            lines += [f"  {k:<24} {_cell(v, '{:.2f}x')}" for k, v in shown]
    for label in labels:
        errors: dict[str, int] = {}
        for run in result.runs:
            if run.label == label:
                for reason, count in (run.summary.get("errors") or {}).items():
                    errors[reason] = errors.get(reason, 0) + count
        for reason, count in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{label}: {count} failed: {reason}")
    return "\n".join(lines)


def _format_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
