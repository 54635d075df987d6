"""What the doctor concludes, question by question, and how it is written out.

A `Finding` holds one question's evidence (numbers, and how each was obtained), its verdict, the
settings it recommends (EngineConfig fields: empty when nothing needs changing), the gain it predicts
and the pitfalls it found. `render_markdown` writes report.md; `recommended_settings` merges the
findings' settings into the mapping `tokenmill serve --config` loads (recommended.yaml); `serve_flags`
spells them as flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Finding:
    question: str  # e.g. "1. Model fit"
    verdict: str
    evidence: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    predicted_gain: str | None = None
    pitfalls: list[str] = field(default_factory=list)

    @property
    def recommends(self) -> bool:
        return bool(self.settings)


def stat(summary: dict[str, Any], metric: str, key: str) -> float:
    """A run summary's `key` ("median", "p90", "p99") of `metric` (ms); 0 when no request gave one."""
    dist = summary.get(metric)
    return float(dist[key]) if dist else 0.0


def p50(summary: dict[str, Any], metric: str) -> float:
    return stat(summary, metric, "median")


def p90(summary: dict[str, Any], metric: str) -> float:
    return stat(summary, metric, "p90")


def p99(summary: dict[str, Any], metric: str) -> float:
    return stat(summary, metric, "p99")


def recommended_settings(findings: list[Finding]) -> dict[str, Any]:
    """Every finding's settings, in question order (a later question's value for a field wins)."""
    merged: dict[str, Any] = {}
    for f in findings:
        merged.update(f.settings)
    return merged


def serve_flags(settings: dict[str, Any]) -> str:
    """{"max_num_seqs": 32, "enable_prefix_caching": True} -> "--max-num-seqs 32 --enable-prefix-caching"."""
    parts = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:  # (an optional setting unset: no flag gives it, the configuration leaves it out)
            parts.append(f"(without {flag})")
        elif value is True:
            parts.append(flag)
        elif value is False:
            parts.append("--no-" + key.replace("_", "-"))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def render_markdown(title: str, preamble: list[str], findings: list[Finding]) -> str:
    lines = [f"# {title}", "", *preamble, ""]
    settings = recommended_settings(findings)
    lines.append("## Recommended")
    lines.append("")
    if settings:
        lines.append(f"`tokenmill serve MODEL {serve_flags(settings)}` (or `--config recommended.yaml`)")
        for f in findings:
            if f.recommends:
                gain = f" — {f.predicted_gain}" if f.predicted_gain else ""
                lines.append(f"- {f.question}: {serve_flags(f.settings)}{gain}")
    else:
        lines.append("Nothing new: the current settings suit this workload.")
    lines.append("")
    for f in findings:
        lines += render_finding(f)
    return "\n".join(lines)


def render_finding(f: Finding) -> list[str]:
    """One question's section of report.md: its verdict, evidence, settings, gain and pitfalls."""
    lines = [f"## {f.question}", "", f"**{f.verdict}**", ""]
    lines += [f"- {e}" for e in f.evidence]
    if f.settings:
        lines += ["", f"Settings: `{serve_flags(f.settings)}`"]
    if f.predicted_gain:
        lines += ["", f"Predicted: {f.predicted_gain}"]
    lines += [f"\nPitfall: {p}" for p in f.pitfalls]
    lines.append("")
    return lines
