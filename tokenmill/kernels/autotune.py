"""The autotune cache: every choice tokenmill makes from a timing at start goes through here.

A choice (which matrix kernel for a weight shape and a class of row counts, whether the greedy argmax
runs inside the output projection, which dtype is fastest) is measured once on a machine and then
read back, so a second start on the same machine makes the same choices (reproducible runs), and
starts fast. Entries are keyed by the machine (the CPU's instruction-set flags, torch's version, the
device, the thread count and the native kernels' sources: the things a timing depends on) and then
by the op and its shape. The cache is one JSON file, `$TOKENMILL_CACHE_DIR/autotune.json` (default
`~/.cache/tokenmill/autotune.json`; `$TOKENMILL_AUTOTUNE_CACHE_DIR` moves it), rewritten whole (write,
then rename) after each new choice.

A measurement: each candidate runs once untimed, then `repeats` rounds in which every candidate runs
once in turn (interleaved, so a noisy moment hits all of them); the median per candidate decides.

Two modes. Measuring (`measure=True`: `tokenmill tune`, `--dtype fastest`, the offline tools) times
a choice the cache lacks, with a progress bar when one is attached (`progress`). Not measuring (a
server's start-up): a choice the cache lacks is the caller's `default` (kernels/defaults.py's table
by CPU kind and row class), returned at once, marked `source="default"` and not written, so a later
`tokenmill tune` measures it. `counts` tallies each source for the start-up's log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from tokenmill.kernels.cpu_build import cpu_flags, sources_hash
from tokenmill.kernels.defaults import CpuKind
from tokenmill.model_files import cache_home

logger = logging.getLogger("tokenmill")


Source = Literal["cache", "measured", "default"]
# (candidates, repeats, sync) -> median milliseconds per candidate
Timer = Callable[[Mapping[str, Callable[[], object]], int, Callable[[], None]], dict[str, float]]


class Progress(Protocol):
    """What the tuner needs of a progress bar (tqdm's)."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> object: ...


@dataclass(frozen=True)
class Choice:
    """The candidate picked, each candidate's median time in milliseconds (none for a default), and
    where it came from: read from the cache, measured now, or the untimed default."""

    name: str
    timings_ms: dict[str, float]
    source: Source

    @property
    def cached(self) -> bool:
        return self.source == "cache"


def default_cache_path() -> Path:
    """`$TOKENMILL_AUTOTUNE_CACHE_DIR/autotune.json` where set (a test session's folder), else in the cache home."""
    own = os.environ.get("TOKENMILL_AUTOTUNE_CACHE_DIR")
    return (Path(own) if own else cache_home()) / "autotune.json"


def machine_key(device: torch.device) -> str:
    """What a timing depends on besides the op: CPU flags, torch version, device, threads, and the
    native kernels' sources (a changed kernel is timed again)."""
    parts = [cpu_flags(), str(torch.__version__), str(device), str(torch.get_num_threads()), sources_hash()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def time_candidates(
    candidates: Mapping[str, Callable[[], object]], repeats: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median milliseconds per candidate over `repeats` interleaved rounds, after one untimed call each."""
    for fn in candidates.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            sync()
            runs[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(times) for name, times in runs.items()}


class Autotuner:
    """Choices by measurement (or, not measuring, by default), remembered per machine in a JSON file
    (None: in memory only). `timer` is what measures (tests swap it)."""

    def __init__(
        self, device: torch.device, path: Path | None, measure: bool = True, timer: Timer = time_candidates
    ) -> None:
        self.device = device
        self.path = path
        self.key = machine_key(device)
        self.cpu = CpuKind.from_flags(cpu_flags())  # what the defaults go by
        self.measure = measure
        self.timer = timer
        self.progress: Progress | None = None
        self.counts: Counter[str] = Counter()  # source -> choices made so
        self.missed: list[str] = []  # the choices given a default, in order ("op|shape")
        self._entries: dict[str, dict[str, object]] = self._read().get(self.key, {}) if path else {}

    def choose(
        self,
        op: str,
        shape: str,
        candidates: Mapping[str, Callable[[], object]],
        repeats: int = 5,
        default: str | None = None,
    ) -> Choice:
        """The fastest of `candidates` for `op` at `shape` (a string the caller makes of what the
        timing depends on): read back from the cache while the candidates are the same ones, else
        measured now, or (not measuring) `default`, which must then be one of the candidates."""
        key = f"{op}|{shape}"
        entry = self._entries.get(key)
        # a choice made among other candidates (a kernel added since, or AMX granted now) is made again
        if entry is not None and set(entry.get("ms", {})) == set(candidates):
            self.counts["cache"] += 1
            return Choice(str(entry["choice"]), dict(entry["ms"]), "cache")  # type: ignore[call-overload]
        if not self.measure:
            if default not in candidates:
                raise ValueError(f"autotune: {op} has no default among {', '.join(candidates)} (got {default!r})")
            self.counts["default"] += 1
            self.missed.append(key)
            return Choice(default, {}, "default")
        timings = self.timer(candidates, repeats, self._sync)
        name = min(timings, key=lambda n: timings[n])
        self._entries[key] = {"choice": name, "ms": {n: round(t, 4) for n, t in timings.items()}}
        self._write()
        self.counts["measured"] += 1
        if self.progress is not None:
            self.progress.set_postfix_str(f"{op} {shape.split(' at ')[0].split(' in a step')[0]}", refresh=False)
            self.progress.update(1)
        return Choice(name, timings, "measured")

    def summary(self) -> str:
        """The choices made so far by source, for the log: "12 (9 cached, 3 defaults)"."""
        words = {"cache": "cached", "measured": "measured", "default": "defaults"}
        parts = [f"{self.counts[s]} {w}" for s, w in words.items() if self.counts[s]]
        return f"{sum(self.counts.values())} ({', '.join(parts) or 'none'})"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _read(self) -> dict[str, dict[str, dict[str, object]]]:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # unreadable: start afresh, and say so
            logger.warning("autotune cache %s unreadable (%s); measuring again", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            data = self._read()
            data[self.key] = {**data.get(self.key, {}), **self._entries}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only home: choices still hold for this run
            logger.warning("autotune cache %s not written (%s)", self.path, exc)
