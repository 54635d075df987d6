"""`trace:FILE`: a trace `tokenmill serve --record-trace FILE` wrote (server/trace_recorder.py), read into
`TraceRow`s.

FILE's rotated parts (FILE.1, FILE.2, ...) are read first, oldest first, then FILE. A header line starts
each recording run (and each part): its block size, its privacy mode and its run id. Block hashes are
keyed by (run, hash): two runs drew different salts, so their hashes never compare (and do not collide).
Arrivals are placed on one clock across runs by each header's start time. A request that ran n
sequences becomes n rows of the same prompt and arrival, each with its share of the output tokens.
What the server measured (TTFT, TPOT, the finish reason, the prompt tokens its prefix cache served) is
kept on each row, for the report to set beside the replay.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from tokenmill.doctor.traces.rows import Measured, ParsedTrace, RowCollector, TraceRow, Window
from tokenmill.server.trace_recorder import FORMAT_VERSION, rotated_parts


def read_recorded(path: Path, window: Window, limit: int | None) -> ParsedTrace:
    parts = rotated_parts(path)
    if not parts:
        raise ValueError(f"--workload: cannot read {path} (no such file)")
    rows = RowCollector(window, limit)
    header: dict[str, Any] | None = None
    block_sizes: set[int] = set()
    finishes: Counter[str] = Counter()
    for part in parts:
        try:
            lines = part.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"--workload: cannot read {part} ({e.strerror or e})") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{part} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if "tokenmill_trace" in row:
                header = _header(row, where)
                block_sizes.add(header["block_size"])
                continue
            if header is None:
                raise ValueError(
                    f"{where}: a request line before the header line (not a tokenmill --record-trace file)"
                )
            for r in _rows(row, header, where, rows):
                rows.rows.append(r)
                finishes[r.measured.finish if r.measured else "?"] += 1
            if rows.done:
                break
    if len(block_sizes) > 1:
        raise ValueError(f"{path}: runs recorded with different block sizes ({sorted(block_sizes)})")
    notes = []
    if rows.rows:
        n = len(rows.rows)
        notes.append("finish reasons as served: " + ", ".join(f"{k} {c / n:.0%}" for k, c in finishes.most_common()))
    block = block_sizes.pop() if block_sizes else None
    return ParsedTrace(f"trace:{path}", rows.rows, block, notes)


def _header(row: dict[str, Any], where: str) -> dict[str, Any]:
    if row.get("tokenmill_trace") != FORMAT_VERSION:
        raise ValueError(f"{where}: trace format {row.get('tokenmill_trace')!r}; this tokenmill reads {FORMAT_VERSION}")
    block = row.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{where}: block_size must be a positive integer, got {block!r}")
    start = row.get("started_unix")
    if isinstance(start, bool) or not isinstance(start, int | float) or not math.isfinite(start):
        raise ValueError(f"{where}: started_unix must be a number, got {start!r}")
    return {"block_size": block, "run": str(row.get("run", "")), "start": float(start)}


def _number(row: dict[str, Any], key: str, where: str, optional: bool = False) -> float | None:
    value = row.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _rows(row: dict[str, Any], header: dict[str, Any], where: str, rows: RowCollector) -> list[TraceRow]:
    """The request line's rows (one per sequence), [] when outside the window."""
    arrival = _number(row, "arrival", where)
    assert arrival is not None
    prompt_len, output_len = int(_number(row, "prompt_len", where) or 0), int(_number(row, "output_len", where) or 0)
    n = max(1, int(_number(row, "n", where, optional=True) or 1))
    hashes, ids = row.get("hashes"), row.get("prompt_token_ids")
    blocks = token_ids = None
    if isinstance(ids, list):
        if len(ids) != prompt_len or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be prompt_len non-negative integers")
        token_ids = ids
    elif isinstance(hashes, list):
        if len(hashes) != -(-prompt_len // header["block_size"]) or not all(isinstance(h, str) for h in hashes):
            raise ValueError(f"{where}: hashes must be one string per {header['block_size']}-token block of the prompt")
        blocks = [(header["run"], h) for h in hashes]
    else:
        raise ValueError(f"{where}: neither hashes nor prompt_token_ids")
    rel = rows.at(header["start"] + arrival)
    if rel is None or prompt_len < 1 or output_len < 1:
        return []
    measured = Measured(
        _number(row, "ttft", where, optional=True),
        _number(row, "tpot", where, optional=True),
        str(row.get("finish", "?")),
        int(_number(row, "cached", where, optional=True) or 0),
    )
    share = [output_len // n + (1 if i < output_len % n else 0) for i in range(n)]
    return [TraceRow(rel, prompt_len, s, blocks, token_ids, measured) for s in share if s > 0]
