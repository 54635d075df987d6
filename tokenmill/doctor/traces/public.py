"""The public production traces, read into `TraceRow`s: Azure's, BurstGPT's and Mooncake's.

- `azure:FILE.csv` (Azure/AzurePublicDataset, `data/AzureLLMInferenceTrace_{code,conv}.csv` and the
  2024 files): columns `TIMESTAMP` (a date and time, e.g. `2023-11-16 18:17:03.9799600`),
  `ContextTokens`, `GeneratedTokens`. No prompt content: no prefix sharing can be replayed.
- `burstgpt:FILE.csv` (HPMLL/BurstGPT, the schema of its README): `Timestamp` (seconds from the first
  day's midnight), `Model`, `Request tokens`, `Response tokens`, `Total tokens`, `Log Type` (and, in its
  newer files, `Session ID`, `Elapsed time`). Rows with 0 response tokens are failed requests (the README
  says so): skipped and counted.
- `mooncake:FILE.jsonl` (kvcache-ai/Mooncake, `FAST25-release/traces/`): one object a line, `timestamp`
  (milliseconds), `input_length`, `output_length`, `hash_ids` (one id per 512-token block of the
  prompt, the last possibly partial; equal ids mean equal prefixes).

Every bad row is a ValueError naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tokenmill.doctor.traces.rows import ParsedTrace, RowCollector, TraceRow, Window

MOONCAKE_BLOCK = 512  # tokens a Mooncake hash id covers (its README)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8", newline="") as f:
            yield from enumerate(f, start=1)
    except OSError as e:
        raise ValueError(f"--workload: cannot read {path} ({e.strerror or e})") from None


def _count(value: Any, where: str, name: str) -> int:
    """A token count: a non-negative integer (CSV text or JSON number)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0 or number != int(number):
        raise ValueError(f"{where}: {name} must be a whole number of tokens >= 0, got {value!r}")
    return int(number)


def _csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str]]]:
    """(where, row) of a CSV file with a header naming at least `required`."""
    lines = (line for _, line in _lines(path))
    reader = csv.DictReader(lines)
    header = [h.strip() for h in reader.fieldnames or []]
    missing = [c for c in required if c not in header]
    if missing:
        raise ValueError(f"{path}: not the expected CSV: no column {', '.join(missing)} (has {', '.join(header)})")
    reader.fieldnames = header
    for row in reader:
        yield f"{path} line {reader.line_num}", row


def read_azure(path: Path, window: Window, limit: int | None) -> ParsedTrace:
    rows = RowCollector(window, limit)
    skipped = 0
    for where, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            t = datetime.fromisoformat(row["TIMESTAMP"].strip()).replace(tzinfo=UTC).timestamp()
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP must be a date and time, got {row['TIMESTAMP']!r}") from None
        prompt = _count(row["ContextTokens"], where, "ContextTokens")
        output = _count(row["GeneratedTokens"], where, "GeneratedTokens")
        rel = rows.at(t)
        if rel is not None:
            if prompt < 1 or output < 1:
                skipped += 1
            else:
                rows.rows.append(TraceRow(rel, prompt, output))
        if rows.done:
            break
    notes = [f"{skipped} rows with 0 context or generated tokens skipped"] if skipped else []
    return ParsedTrace(f"azure:{path}", rows.rows, None, notes)


def read_burstgpt(path: Path, window: Window, limit: int | None) -> ParsedTrace:
    rows = RowCollector(window, limit)
    failed = empty = 0
    models: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for where, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        try:
            t = float(row["Timestamp"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: Timestamp must be seconds, got {row['Timestamp']!r}") from None
        prompt = _count(row["Request tokens"], where, "Request tokens")
        output = _count(row["Response tokens"], where, "Response tokens")
        rel = rows.at(t)
        if rel is not None:
            if output == 0:
                failed += 1
            elif prompt == 0:
                empty += 1
            else:
                rows.rows.append(TraceRow(rel, prompt, output))
                models[(row.get("Model") or "?").strip()] += 1
                kinds[(row.get("Log Type") or "?").strip()] += 1
        if rows.done:
            break
    notes = []
    if failed:
        notes.append(f"{failed} failed requests (0 response tokens) skipped")
    if empty:
        notes.append(f"{empty} rows with 0 request tokens skipped")
    if rows.rows:
        n = len(rows.rows)
        notes.append(
            "models: "
            + ", ".join(f"{m} {c / n:.0%}" for m, c in models.most_common())
            + "; log types: "
            + ", ".join(f"{k} {c / n:.0%}" for k, c in kinds.most_common())
        )
    return ParsedTrace(f"burstgpt:{path}", rows.rows, None, notes)


def read_mooncake(path: Path, window: Window, limit: int | None) -> ParsedTrace:
    rows = RowCollector(window, limit)
    skipped = 0
    for number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with timestamp, input_length, output_length, hash_ids")
        ms = row.get("timestamp")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
            raise ValueError(f"{where}: timestamp must be milliseconds, got {ms!r}")
        prompt = _count(row.get("input_length"), where, "input_length")
        output = _count(row.get("output_length"), where, "output_length")
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers")
        if len(ids) < -(-prompt // MOONCAKE_BLOCK):
            raise ValueError(
                f"{where}: hash_ids has {len(ids)} ids for {prompt} tokens (one per {MOONCAKE_BLOCK}-token block)"
            )
        rel = rows.at(ms / 1000)
        if rel is not None:
            if prompt < 1 or output < 1:
                skipped += 1
            else:
                rows.rows.append(TraceRow(rel, prompt, output, blocks=list(ids)))
        if rows.done:
            break
    notes = [f"{skipped} rows with 0 input or output tokens skipped"] if skipped else []
    return ParsedTrace(f"mooncake:{path}", rows.rows, MOONCAKE_BLOCK, notes)
