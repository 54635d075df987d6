"""Variants and repeats: `--compare KEY=VAL,KEY=VAL ...` parsed into engine-config overrides (typed
from EngineConfig's fields, engine_args.parse_value), and the
aggregates a result file carries: each label's metrics over repeats (median, min, max), and each
label's gain over a base label, computed repeat by repeat (runs of one repeat ran side by side).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tokenmill.bench.metrics import flatten, gain, spread
from tokenmill.bench.records import BenchResult, Run
from tokenmill.config import EngineConfig
from tokenmill.engine_args import parse_value


def parse_variant(text: str, base: EngineConfig) -> dict[str, Any]:
    """ "scheduling=static,max_num_seqs=8" -> {"scheduling": "static", "max_num_seqs": 8}, each value
    typed as its EngineConfig field (keys in snake_case or kebab-case) and checked against `base`
    with the variant applied; a ValueError names a bad key or value."""
    fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    overrides: dict[str, Any] = {}
    for part in _top_level_parts(text):
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"--compare: {part!r} is not KEY=VALUE with KEY an engine setting ({', '.join(fields)})")
        try:
            overrides[key] = parse_value(EngineConfig, key, raw.strip())
        except ValueError as e:
            raise ValueError(f"--compare: {e}") from None
    try:
        dataclasses.replace(base, **overrides)
    except ValueError as e:
        raise ValueError(f"--compare: {text!r}: {e}") from None
    return overrides


def _top_level_parts(text: str) -> list[str]:
    """Split at the commas outside braces, brackets and quotes: a JSON value (speculative_config={...})
    keeps its own commas."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def label_of(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k}={_show(v)}" for k, v in overrides.items()) or "tokenmill"


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def labels_in_order(runs: Sequence[Run]) -> list[str]:
    seen: dict[str, None] = {}
    for run in runs:
        seen.setdefault(run.label, None)
    return list(seen)


def aggregate(result: BenchResult, bases: Sequence[str] = ()) -> None:
    """Fill `result.aggregate` (every label, every numeric metric over repeats) and `result.gains`
    (every other label over each base label in `bases`, repeat by repeat)."""
    flat: dict[str, dict[int, dict[str, float]]] = {}
    for run in result.runs:
        flat.setdefault(run.label, {})[run.repeat] = flatten(run.summary, run.extras)
    result.aggregate = {
        label: {
            metric: spread([r[metric] for r in repeats.values() if metric in r])
            for metric in _metrics(repeats.values())
        }
        for label, repeats in flat.items()
    }
    result.gains = {}
    for b, base in enumerate(bases):
        for label in labels_in_order(result.runs):
            if label in bases[b:] or base not in flat:  # not a base over itself, nor over an earlier base
                continue
            gains: dict[str, Any] = {}
            for metric in _metrics(flat[label].values()):
                samples = [
                    g
                    for rep, values in flat[label].items()
                    if metric in values
                    and metric in flat[base].get(rep, {})
                    and (g := gain(metric, values[metric], flat[base][rep][metric])) is not None
                ]
                if samples:
                    gains[metric] = spread(samples)
            result.gains[f"{label} over {base}"] = gains


def _metrics(repeats: Any) -> list[str]:
    names: dict[str, None] = {}
    for values in repeats:
        names.update(dict.fromkeys(values))
    return list(names)
