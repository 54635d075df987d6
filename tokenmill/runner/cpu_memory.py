"""Keep freed memory in the process heap on CPU, so large per-step temporaries do not page-fault.

glibc serves allocations above its mmap threshold with fresh mappings and returns them to the
system when freed. An engine step allocates and frees many multi-megabyte temporaries (gathered
K/V, attention scores, activations), so each step would fault every one of their pages in again,
which can double a decode step's time. Raising the mmap and trim thresholds lets the heap keep and
reuse them.

What a heap keeps it keeps per arena, and glibc gives threads arenas of their own (up to eight per
core): a server's threads (the event loop, the engine's core, grammar compiles, tokenizers) would
each come to hold a copy of the step's temporaries, and the process's memory would climb in steps
for as long as new threads meet them. The arenas are capped at `MAX_ARENAS`, so what is kept is
bounded by a few copies of one step's working set.

Freed memory in the middle of a heap is not returned either, so a heap's size is the high-water
mark of every step it has met, with its fragmentation: a rare large step (a long context in a full
batch) raises it for good. `HeapTrimmer` hands the free pages back to the system now and then
(`malloc_trim`), at most once per `TRIM_INTERVAL_S` between steps: the next step faults its
temporaries in once, and the process's memory follows what is in use rather than what ever was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("tokenmill")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAX_ARENAS = 2
THRESHOLD_BYTES = 1 << 30
TRIM_INTERVAL_S = 60.0


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process and cap its arenas; False where glibc is
    not in use (or refuses)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    ok = bool(mallopt(M_ARENA_MAX, MAX_ARENAS))
    ok = ok and bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    if not ok:
        logger.info("could not raise glibc's malloc thresholds; CPU steps may page-fault their temporaries")
    return ok


def trim_heap() -> bool:
    """Return the free pages of every glibc arena to the system; False where glibc is not in use."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


class HeapTrimmer:
    """Calls `trim` when `tick` finds `interval_s` passed since the last call (the clock injectable)."""

    def __init__(
        self,
        trim: Callable[[], object] = trim_heap,
        interval_s: float = TRIM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trim, self.interval_s, self.clock = trim, interval_s, clock
        self.last = clock()
        self.trims = 0

    def tick(self) -> None:
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.trim()
            self.last = self.clock()
            self.trims += 1
