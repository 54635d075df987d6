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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("tokenmill")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAX_ARENAS = 2
THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process and cap its arenas; False where glibc is
    not in use (or refuses)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_ARENA_MAX, MAX_ARENAS))
    ok = ok and bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    if not ok:
        logger.info("could not raise glibc's malloc thresholds; CPU steps may page-fault their temporaries")
    return ok
