"""The doctor's charts and report.html: length distributions, the prefix-cache hit rate by cache size,
the step-cost curves, and TTFT / TPOT CDFs of the current settings against the recommended ones.

Draws with matplotlib's object API (`Figure` + `FigureCanvasAgg`: no display, no pyplot state), writes
PNGs beside report.md, and an HTML page that holds the findings (escaped) and the charts (embedded).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tokenmill.bench.records import RequestRecord
from tokenmill.doctor.findings import Finding, recommended_settings, serve_flags
from tokenmill.doctor.step_cost import StepCost

DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))  # type: ignore[no-untyped-call]
    return path


def lengths_chart(prompts: Sequence[int], outputs: Sequence[int], path: Path) -> Path:
    fig = Figure(figsize=(10, 3.6), dpi=DPI)
    for i, (values, title) in enumerate(((prompts, "input tokens"), (outputs, "output tokens"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.hist(values, bins=min(40, max(5, len(set(values)))), color="#4477aa")
        ax.set_xlabel(title)
        ax.set_ylabel("requests")
    return _save(fig, path)


def hit_rate_chart(curve: Sequence[tuple[int, float]], current_blocks: int, path: Path) -> Path:
    """curve: (cache blocks, LRU hit rate) pairs."""
    fig = Figure(figsize=(6, 3.6), dpi=DPI)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([b for b, _ in curve], [r * 100 for _, r in curve], marker="o", color="#228833")
    ax.axvline(current_blocks, color="#999999", linestyle="--", label=f"current ({current_blocks} blocks)")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache blocks")
    ax.set_ylabel("prefix-hit rate (%)")
    ax.legend()
    return _save(fig, path)


def step_cost_chart(cost: StepCost, path: Path) -> Path:
    fig = Figure(figsize=(10, 3.6), dpi=DPI)
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(cost.prompt_tokens, [s * 1e3 for s in cost.prompt_seconds], marker="o", color="#aa3377")
    ax.set_xlabel("tokens in a one-request prompt step")
    ax.set_ylabel("ms (attention excluded)")
    ax = fig.add_subplot(1, 2, 2)
    for context in (128, 1024):
        ax.plot(
            cost.decode_batch,
            [cost.decode_step(b, context) * 1e3 for b in cost.decode_batch],
            marker="o",
            label=f"context {context}",
        )
    ax.set_xlabel("requests decoding")
    ax.set_ylabel("ms a step")
    ax.legend()
    return _save(fig, path)


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """runs: label -> request records (the simulator's)."""
    fig = Figure(figsize=(10, 3.6), dpi=DPI)
    for i, metric in enumerate(("ttft", "tpot")):
        ax = fig.add_subplot(1, 2, i + 1)
        for label, records in runs.items():
            values = sorted(
                v * 1e3 for r in records if r.ok and (v := (r.ttft_s if metric == "ttft" else r.tpot_s)) is not None
            )
            if values:
                ax.plot(values, [(k + 1) / len(values) for k in range(len(values))], label=label)
        ax.set_xlabel(f"{metric.upper()} (ms, simulated)")
        ax.set_ylabel("share of requests")
        ax.legend()
    return _save(fig, path)


def render_html(title: str, preamble: Sequence[str], findings: Sequence[Finding], charts: Sequence[Path]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title></head><body>"]
    parts.append(f"<h1>{e(title)}</h1>")
    parts += [f"<p>{e(p)}</p>" for p in preamble]
    settings = recommended_settings(list(findings))
    parts.append("<h2>Recommended</h2>")
    if settings:
        parts.append(f"<p><code>tokenmill serve MODEL {e(serve_flags(settings))}</code></p>")
    else:
        parts.append("<p>Nothing new: the current settings suit this workload.</p>")
    for f in findings:
        parts.append(f"<h2>{e(f.question)}</h2><p><b>{e(f.verdict)}</b></p><ul>")
        parts += [f"<li>{e(x)}</li>" for x in f.evidence]
        parts.append("</ul>")
        if f.settings:
            parts.append(f"<p>Settings: <code>{e(serve_flags(f.settings))}</code></p>")
        if f.predicted_gain:
            parts.append(f"<p>Predicted: {e(f.predicted_gain)}</p>")
        parts += [f"<p>Pitfall: {e(p)}</p>" for p in f.pitfalls]
    for chart in charts:
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        parts.append(f"<h3>{e(chart.stem.replace('_', ' '))}</h3><img src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
