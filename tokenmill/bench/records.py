"""What one benchmark run writes: per-request records, runs, and the result file that holds them.

Plain dataclasses, so the HTTP client, the offline driver and the transformers baseline all produce
the same thing and `metrics`, `report` and `plot` read one shape. Times are seconds, measured from
the start of the run with `time.perf_counter`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULT_VERSION = 1


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    index: int  # position in the workload
    ok: bool
    error: str | None = None  # why it failed (HTTP status and message, dropped connection, ...)
    start_s: float = 0.0  # when it was sent, from the start of the run
    prompt_tokens: int | None = None  # from the server's usage, the engine, or the workload
    output_tokens: int = 0  # from usage (or the tokenizer / the engine); never the number of chunks
    cached_tokens: int | None = None  # prompt tokens served from a prefix cache, where reported
    ttft_s: float | None = None  # send -> first token
    e2e_s: float | None = None  # send -> last token
    itl_s: list[float] = field(default_factory=list)  # gaps between successive token arrivals

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1); None below two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Run:
    """One pass of a workload under one configuration (a variant, a sweep point, a repeat)."""

    label: str  # e.g. "scheduling=static" or "max-concurrency=8"
    repeat: int
    settings: dict[str, Any]  # what distinguishes this run (variant overrides, sweep value)
    duration_s: float
    records: list[RequestRecord]
    summary: dict[str, Any] = field(default_factory=dict)  # metrics.summarize(...)
    extras: dict[str, Any] = field(default_factory=dict)  # engine-side measurements (KV use, overhead)


@dataclass
class BenchResult:
    """A result file: the command, the workload, every run, and the aggregates over repeats."""

    tool: str  # "serve" | "offline"
    command: list[str]
    workload: dict[str, Any]
    config: dict[str, Any]
    runs: list[Run]
    aggregate: dict[str, Any] = field(default_factory=dict)  # label -> metric -> {median, min, max, samples}
    gains: dict[str, Any] = field(default_factory=dict)  # "A over B" -> metric -> {median, min, max, samples}
    version: int = RESULT_VERSION

    def write(self, path: Path) -> None:
        """Strict JSON (no NaN), written to a temporary file and renamed, so no half file is left.
        Record times are kept to the microsecond (a clock's resolution here, and a third of the size)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        for run in data["runs"]:
            for rec in run["records"]:
                for key in ("start_s", "ttft_s", "e2e_s"):
                    if rec[key] is not None:
                        rec[key] = round(rec[key], 6)
                rec["itl_s"] = [round(x, 6) for x in rec["itl_s"]]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        tmp.replace(path)


def read_result(path: Path) -> BenchResult:
    """A result file written by `BenchResult.write`; a ValueError names what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such result file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    version = raw.get("version") if isinstance(raw, dict) else None
    if type(version) is not int or version != RESULT_VERSION or not isinstance(raw.get("runs"), list):
        raise ValueError(f"{path}: not a tokenmill bench result (version {RESULT_VERSION})")
    try:
        runs = []
        for r in raw["runs"]:
            records = [RequestRecord(**rec) for rec in r.pop("records")]
            runs.append(Run(records=records, **r))
        raw["runs"] = runs
        return BenchResult(**raw)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a tokenmill bench result (a malformed run or record: {e})") from None
