"""Hardware the doctor answers for: spec sheets (built in or a user's YAML) and this machine's own roofline.

A `Target` is what a roofline needs of a machine: memory, memory read bandwidth and peak dense matrix
throughput per compute dtype, each figure with where it came from, and a price an hour only where the
user gave one (`--price-per-hour` or the YAML's `price_per_hour`: none is built in). The built-in sheets
are the YAML files in `specs/` (NVIDIA's datasheets, dense Tensor Core figures: the datasheets' "with
sparsity" figures halved), read by the same validation as a user's file, so a bad file is named with
its field. `here` is this machine: its memory from the OS, its bandwidth and peak measured on the
spot (`measure_here`: a buffer past the caches summed, a square matmul in the engine's dtype), so
the calibration's roofline is this machine's measured one, not a datasheet's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SPECS = Path(__file__).resolve().parent / "specs"
DTYPES = ("float32", "bfloat16", "fp8", "int8")  # compute dtypes a sheet may give a peak for
BUILT_IN = tuple(sorted(p.stem for p in SPECS.glob("*.yaml")))


class TargetError(ValueError):
    """A target that cannot be read: the message names the file and field."""


@dataclass
class Target:
    name: str
    description: str
    memory_bytes: int
    bandwidth: float  # bytes a second, memory read
    peak_flops: dict[str, float]  # compute dtype -> dense FLOP/s (int8: OP/s)
    source: str  # where the figures come from (a URL, a file, "measured on this machine")
    price_per_hour: float | None = None
    measured: bool = False  # the figures were measured here, not read from a sheet
    notes: list[str] = field(default_factory=list)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise TargetError(
                f"target {self.name}: no {dtype} peak on its sheet (it gives {', '.join(self.peak_flops)})"
            )
        return self.peak_flops[dtype]


def _number(raw: dict[str, Any], key: str, where: str, required: bool = True) -> float | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        what = "missing" if value is None else f"{value!r}"
        raise TargetError(f"{where}: {key!r} must be a number above 0 (got {what})")
    return float(value)


def parse_target(raw: Any, where: str) -> Target:
    """A spec sheet's mapping -> Target; `where` names the file in errors."""
    if not isinstance(raw, dict):
        raise TargetError(f"{where}: expected a mapping of name, memory_gb, bandwidth_gbs, tflops, source")
    unknown = set(raw) - {"name", "description", "memory_gb", "bandwidth_gbs", "tflops", "source", "price_per_hour"}
    if unknown:
        raise TargetError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TargetError(f"{where}: 'name' must be a non-empty string")
    source = raw.get("source")
    if not isinstance(source, str) or not source:
        raise TargetError(f"{where}: 'source' must say where the figures come from (a datasheet's URL)")
    tflops = raw.get("tflops")
    if not isinstance(tflops, dict) or not tflops:
        raise TargetError(f"{where}: 'tflops' must map compute dtypes ({', '.join(DTYPES)}) to dense peak TFLOPS")
    bad = set(tflops) - set(DTYPES)
    if bad:
        raise TargetError(f"{where}: 'tflops' has {', '.join(sorted(bad))}; the dtypes are {', '.join(DTYPES)}")
    peaks = {k: _number(tflops, k, f"{where}: tflops") * 1e12 for k in tflops}  # type: ignore[operator]
    memory = _number(raw, "memory_gb", where)
    bandwidth = _number(raw, "bandwidth_gbs", where)
    price = _number(raw, "price_per_hour", where, required=False)
    return Target(
        name,
        str(raw.get("description", name)),
        int(memory * 1e9),  # type: ignore[operator]
        bandwidth * 1e9,  # type: ignore[operator]
        peaks,
        source,
        price,
    )


def load_target(spec: str, price_per_hour: float | None = None) -> Target:
    """A built-in name (h100, h200, a100-80g, l40s, l4) or a YAML file; `price_per_hour` overrides the file's."""
    path = SPECS / f"{spec}.yaml" if spec in BUILT_IN else Path(spec)
    if spec not in BUILT_IN and not (path.suffix in (".yaml", ".yml") and path.is_file()):
        raise TargetError(f"--target: {spec!r} is not here, {', '.join(BUILT_IN)} or a YAML file that exists")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TargetError(f"{path}: not valid YAML ({e})") from None
    target = parse_target(raw, str(path))
    if price_per_hour is not None:
        target.price_per_hour = price_per_hour
    return target


def _best_seconds(run: Any, repeats: int) -> float:
    """The fastest of `repeats` timed runs after an untimed one (first touch, kernel selection): a peak is
    what the machine reaches, and on a shared machine other work only ever slows a run."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_here(dtype: Any, memory_bytes: int | None = None, mib: int = 256, n: int = 1024) -> Target:
    """This machine as a roofline target: read bandwidth from summing a float32 buffer of `mib` MiB
    (past the last-level cache) on all torch threads, peak from an n x n x n matmul in float32 or `dtype`
    (the engine's), whichever is faster, memory from the OS unless `memory_bytes` is given; each the
    fastest of 7 timed passes (none for a dtype the CPU emulates, found by its first run)."""
    import torch

    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    bandwidth = buffer.numel() * 4 / _best_seconds(lambda: buffer.sum(), 7)
    peak = 0.0
    for kind in dict.fromkeys((torch.float32, dtype)):
        a, b = torch.randn(n, n).to(kind), torch.randn(n, n).to(kind)
        start = time.perf_counter()
        a @ b  # (a first run, timed roughly: one that takes 32x float32's best, kernel set-up included,
        # is a dtype the CPU emulates (e.g. bfloat16 without AVX-512 BF16 or AMX) and cannot be the peak)
        if peak and 2 * n**3 / (time.perf_counter() - start) < peak / 32:
            continue
        peak = max(peak, 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, 7))
    memory = memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = str(dtype).split(".")[-1]
    timed = "float32" if name == "float32" else f"float32 or {name}"
    return Target(
        "here",
        "this machine",
        int(memory),
        bandwidth,
        dict.fromkeys(DTYPES, peak),
        f"measured on this machine: {mib} MiB summed, {n}^3 matmul ({timed})",
        measured=True,
    )
