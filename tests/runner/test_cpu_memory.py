"""The CPU heap settings: freed step temporaries are kept, in a bounded number of glibc arenas."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

from tokenmill.runner.cpu_memory import MAX_ARENAS, HeapTrimmer

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
    reason="glibc only",
)

# Eight threads each allocate and free 8 MiB blocks, then glibc's malloc_info counts the heaps (arenas).
PROBE = """
import ctypes, ctypes.util, sys, tempfile, threading
from tokenmill.runner.cpu_memory import keep_freed_memory
if sys.argv[1] == "capped":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()  # all eight at once: each wants an arena of its own
    blocks = [libc.malloc(8 << 20) for _ in range(4)]
    barrier.wait()
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(f.name).read().count("<heap nr="))
"""


def _heaps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip())


def test_threads_share_a_bounded_number_of_arenas() -> None:
    assert _heaps("default") > MAX_ARENAS  # the probe does make arenas of its own per thread
    assert _heaps("capped") <= MAX_ARENAS


# 256 MiB in 8 MiB blocks, written and freed: the heap keeps them until trimmed.
KEEP_THEN_TRIM = """
import ctypes, ctypes.util
from tokenmill.runner.cpu_memory import keep_freed_memory, trim_heap
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) >> 10
assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
start = rss()
blocks = [libc.malloc(8 << 20) for _ in range(32)]
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
guard = libc.malloc(64)  # (a live chunk above them: the heap's top cannot simply shrink)
for b in blocks:
    libc.free(b)
kept = rss()
assert trim_heap()
print(start, kept, rss())
"""


def test_freed_memory_is_kept_until_the_heap_is_trimmed() -> None:
    out = subprocess.run([sys.executable, "-c", KEEP_THEN_TRIM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    start, kept, trimmed = map(int, out.stdout.split())  # MiB
    assert kept - start >= 200  # kept for the next step's reuse
    assert kept - trimmed >= 200  # and handed back by the trim


def test_the_trimmer_trims_at_most_once_per_interval() -> None:
    now = [0.0]
    calls: list[float] = []
    trimmer = HeapTrimmer(lambda: calls.append(now[0]), interval_s=60.0, clock=lambda: now[0])
    for t in (1.0, 30.0, 59.9, 60.0, 61.0, 119.0, 130.0):
        now[0] = t
        trimmer.tick()
    assert calls == [60.0, 130.0]
    assert trimmer.trims == 2
