"""`--workload` for the doctor: a built-in workload or a JSONL trace (bench's), or one of the traces read here
(`trace:`, `azure:`, `burstgpt:`, `mooncake:`), windowed, time-scaled and fitted to the model's context.

`load_workload` is the one entry: it returns the workload and, for the traces read here, a `TraceInfo`
(what the report says of the trace: its window, the share clipped, its own block-level reuse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.workloads import DOCTOR_TRACES, BenchTokenizer, Workload, WorkloadSpec, build_workload
from tokenmill.doctor.traces.public import read_azure, read_burstgpt, read_mooncake
from tokenmill.doctor.traces.recorded import read_recorded
from tokenmill.doctor.traces.rows import ParsedTrace, Window
from tokenmill.doctor.traces.shape import Shaping, TraceInfo, shape

READERS: dict[str, Callable[[Path, Window, int | None], ParsedTrace]] = {
    "trace": read_recorded,
    "azure": read_azure,
    "burstgpt": read_burstgpt,
    "mooncake": read_mooncake,
}
assert set(READERS) == set(DOCTOR_TRACES)


@dataclass(frozen=True)
class TraceFlags:
    """The doctor's flags for a trace read here (text as given on the command line)."""

    window: str | None = None  # START:END seconds
    time_scale: float = 1.0
    length_scale: str = "1"  # a number, or "fit"


def parse_length_scale(text: str) -> float | None:
    """ "fit" -> None; "0.25" -> 0.25."""
    if text.strip().lower() == "fit":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--length-scale: {text!r} is not a number or fit") from None


def is_doctor_trace(name: str) -> bool:
    return name.partition(":")[0] in READERS and ":" in name


def load_workload(
    spec: WorkloadSpec,
    tokenizer: BenchTokenizer,
    max_model_len: int,
    vocab_size: int,
    flags: TraceFlags = TraceFlags(),
) -> tuple[Workload, TraceInfo | None]:
    """The workload `spec` names (`spec.num_requests`: at most that many of a trace's window)."""
    kind, _, path = spec.name.partition(":")
    if kind not in READERS:
        if flags != TraceFlags():
            raise ValueError(f"--window, --time-scale, --length-scale: for the {', '.join(READERS)} traces only")
        return build_workload(spec, tokenizer), None
    if not path:
        raise ValueError(f"--workload: {kind}:FILE needs a file")
    window = Window.parse(flags.window)
    how = Shaping(
        max_model_len, vocab_size, window, flags.time_scale, parse_length_scale(flags.length_scale), spec.seed
    )
    parsed = READERS[kind](Path(path), window, spec.num_requests)
    return shape(parsed, how)
