"""The autotune cache: every choice tokenmill makes from a timing at start goes through here.

A choice (which matrix kernel for a weight shape and a class of row counts, whether the greedy argmax
runs inside the output projection, which dtype is fastest) is measured once on a machine and then
read back, so a second start on the same machine makes the same choices (reproducible runs), and
starts fast. Entries are keyed by the machine (the CPU's instruction-set flags, torch's version, the
device, the thread count and the native kernels' sources: the things a timing depends on) and then
by the op and its shape. The cache is one JSON file, `$TOKENMILL_CACHE_DIR/autotune.json` (default
`~/.cache/tokenmill/autotune.json`), rewritten whole (write, then rename) after each new choice.

A measurement: each candidate runs once untimed, then `repeats` rounds in which every candidate runs
once in turn (interleaved, so a noisy moment hits all of them); the median per candidate decides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kernels.cpu_build import cpu_flags, sources_hash

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True)
class Choice:
    """The candidate picked, each candidate's median time in milliseconds, and whether it was read
    from the cache rather than measured now."""

    name: str
    timings_ms: dict[str, float]
    cached: bool


def default_cache_path() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR", Path.home() / ".cache" / "tokenmill")) / "autotune.json"


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
    """Choices by measurement, remembered per machine in a JSON file (None: in memory only)."""

    def __init__(self, device: torch.device, path: Path | None) -> None:
        self.device = device
        self.path = path
        self.key = machine_key(device)
        self._entries: dict[str, dict[str, object]] = self._read().get(self.key, {}) if path else {}

    def choose(self, op: str, shape: str, candidates: Mapping[str, Callable[[], object]], repeats: int = 5) -> Choice:
        """The fastest of `candidates` for `op` at `shape` (a string the caller makes of what the
        timing depends on); measured on the first call on this machine, read back after that (while the
        candidates are the same ones)."""
        entry = self._entries.get(f"{op}|{shape}")
        # a choice made among other candidates (a kernel added since, or AMX granted now) is made again
        if entry is not None and set(entry.get("ms", {})) == set(candidates):
            return Choice(str(entry["choice"]), dict(entry["ms"]), cached=True)  # type: ignore[call-overload]
        timings = time_candidates(candidates, repeats, self._sync)
        name = min(timings, key=lambda n: timings[n])
        self._entries[f"{op}|{shape}"] = {"choice": name, "ms": {n: round(t, 4) for n, t in timings.items()}}
        self._write()
        return Choice(name, timings, cached=False)

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
