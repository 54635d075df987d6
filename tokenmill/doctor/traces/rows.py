"""What every trace format is read into: one `TraceRow` a request, and the `ParsedTrace` around them.

A row has the request's arrival (seconds from the trace's first row), its prompt and output lengths,
and, where the format gives them, its prompt as block ids (`blocks`: equal ids at the same place mean
equal prefixes up to there, each id covering `block_size` tokens, the last one possibly fewer) or as
token ids, and what a server measured of it (a recorded trace). `Window` selects the rows of a time
span while a file is read, so a month-long trace need not be held whole to replay an hour of it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class Measured:
    """What the serving engine measured of a recorded request."""

    ttft_s: float | None
    tpot_s: float | None
    finish: str
    cached_tokens: int


@dataclass
class TraceRow:
    arrival_s: float  # seconds from the trace's first row
    prompt_len: int
    output_len: int
    blocks: list[Hashable] | None = None  # block ids of the prompt, ParsedTrace.block_size tokens each
    token_ids: list[int] | None = None  # the prompt itself
    measured: Measured | None = None


@dataclass
class ParsedTrace:
    source: str  # e.g. "mooncake:traces/conversation_trace.jsonl"
    rows: list[TraceRow]
    block_size: int | None = None  # tokens a block id covers (None: the format has none)
    notes: list[str] = field(default_factory=list)  # what reading skipped or found, for the report


@dataclass(frozen=True)
class Window:
    """The rows whose arrival, in seconds from the trace's first row, is in [start, end)."""

    start: float = 0.0
    end: float = float("inf")

    @classmethod
    def parse(cls, text: str | None) -> Window:
        """ "START:END" in seconds (either side may be empty); None: the whole trace."""
        if not text:
            return cls()
        lo, sep, hi = text.partition(":")
        try:
            start = float(lo) if lo.strip() else 0.0
            end = float(hi) if sep and hi.strip() else float("inf")
        except ValueError:
            raise ValueError(f"--window: {text!r} is not START:END in seconds of the trace") from None
        if not (0 <= start < end):
            raise ValueError(f"--window: need 0 <= START < END, got {text!r}")
        return cls(start, end)

    def __contains__(self, t: float) -> bool:
        return self.start <= t < self.end

    def describe(self) -> str:
        end = "the end" if self.end == float("inf") else f"{self.end:g} s"
        return f"{self.start:g} s to {end} of the trace"


class RowCollector:
    """Rows of a file in its order: times made relative to the first row's, those outside `window`
    dropped; `done` once a file in time order has passed the window's end (the rest need not be read)."""

    def __init__(self, window: Window, limit: int | None) -> None:
        self.window, self.limit = window, limit
        self.rows: list[TraceRow] = []
        self.origin: float | None = None
        self.last = float("-inf")
        self.ordered = True
        self.seen = 0

    def at(self, t: float) -> float | None:
        """The time of a row at absolute time `t`, relative to the first row: None if outside the window."""
        if self.origin is None:
            self.origin = t
        self.seen += 1
        self.ordered = self.ordered and t >= self.last
        self.last = t
        rel = t - self.origin
        return rel if rel in self.window else None

    @property
    def done(self) -> bool:
        past = self.ordered and self.last - (self.origin or 0.0) >= self.window.end
        return past or (self.limit is not None and len(self.rows) >= self.limit)
