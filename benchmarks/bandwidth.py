"""The machine's streaming read bandwidth: what a decode step that reads every weight once can reach.

A buffer well past the last-level cache (at least 16x the L3 and 1 GiB) is read whole, on all of
torch's threads, by two readers: `torch.sum` over float32 (vectorized, each thread a contiguous
range) and `amax` over the same bytes as int8 (the byte loads a quantized kernel makes); and the float32
sum again over a buffer on 2 MB pages (runner/huge_pages.py: where tokenmill keeps its weights, fewer
TLB misses than 4 KB pages). Each pass is timed after one untimed pass; the figure is bytes read over
the median pass time, with the spread. The largest of the readers' medians is the machine's figure: the
ceiling a decode kernel's bytes per second is compared with (issue 44: decode at one request should
read its weights at >= 85% of it).

Usage: python benchmarks/bandwidth.py [--gib 1.0] [--repeats 7] [--out results/bandwidth.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.kernels.cpu_build import cpu_flags
from tokenmill.runner import huge_pages

RESULTS = Path(__file__).resolve().parent / "results"
SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def l3_bytes() -> int:
    """The last-level cache's size from sysfs (0 where it is not said)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * scale)
    return best


def time_reads(read: Callable[[], object], nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of `read` over `nbytes`: median, min and max of `repeats` passes after one untimed."""
    read()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def readers_4kb(nbytes: int, repeats: int) -> dict[str, dict[str, float]]:
    """The two readers over a buffer torch allocates (4 KB pages); the buffer goes on return."""
    f32 = torch.ones(nbytes // 4, dtype=torch.float32)  # [n] (written once: every page is resident)
    i8 = f32.view(torch.int8)  # the same bytes, read as int8
    return {
        "float32_sum": time_reads(lambda: f32.sum(), nbytes, repeats),
        "int8_amax": time_reads(lambda: i8.amax(), nbytes, repeats),
    }


def measure(gib: float, repeats: int) -> dict[str, object]:
    nbytes = max(int(gib * (1 << 30)), 16 * l3_bytes())
    readers = readers_4kb(nbytes, repeats)
    if huge_pages.available():
        huge = huge_pages.huge_zeros((nbytes // 4,), torch.float32)
        huge.fill_(1.0)
        readers["float32_sum_2mb_pages"] = time_reads(lambda: huge.sum(), nbytes, repeats)
    flags = set(cpu_flags().split())
    return {
        "benchmark": "bandwidth",
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "simd": [f for f in SIMD if f in flags],
        "l3_bytes": l3_bytes(),
        "buffer_bytes": nbytes,
        "repeats": repeats,
        "readers_gb_s": readers,
        "read_gb_s": max(r["median"] for r in readers.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size (at least 16x the L3 whatever is given)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS / "bandwidth.json"))
    args = ap.parse_args()
    report = measure(args.gib, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, r in report["readers_gb_s"].items():  # type: ignore[attr-defined]
        print(f"{name:12} {r['median']:6.1f} GB/s [{r['min']:.1f}-{r['max']:.1f}]")
    print(f"read bandwidth: {report['read_gb_s']:.1f} GB/s over {report['buffer_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
