"""Builds and loads tokenmill's native CPU kernels (`csrc/*.cpp`) with `torch.utils.cpp_extension`.

The kernels are compiled for the CPU at hand (`-march=native`, OpenMP through torch's own runtime)
into a cache folder keyed by everything the binary depends on: the CPU's instruction-set flags, the
compiler, torch's version, the flags and the sources. A build made on a CPU with other instructions
(AVX-512 on one machine, AVX2 only on the next) is never loaded; that CPU gets its own build, once
(a compile on first use, one process at a time, the torch headers every source includes parsed once
into a precompiled header; later starts load it from the cache). The ops register under `torch.ops.tokenmill_cpu`.

If no build can be made (no compiler, an unsupported platform), `load_cpu_kernels` logs why on each
call and returns None (the build is tried once a process); callers then run the torch reference ops.
The cache lives in `$TOKENMILL_CACHE_DIR/kernels` (default `~/.cache/tokenmill/kernels`).

`TOKENMILL_MAX_ISA` caps the instructions tokenmill uses, as if the CPU had no more: `avx2` (x86-64-v3:
AVX2, FMA, F16C; no AVX-512, AVX-VNNI or AMX) or `avx512` (no AMX). The build and every default that goes
by the CPU's flags (`cpu_flags`) see the capped set, so a machine of one kind runs and measures another
kind's code paths (docs/native-kernels.md). torch's own kernels take their caps from `ATEN_CPU_CAPABILITY`
and `ONEDNN_MAX_CPU_ISA`, read before torch starts.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.model_files import cache_home

logger = logging.getLogger("tokenmill")

SOURCES = (
    "attention.cpp",
    "kv_write.cpp",
    "layer_ops.cpp",
    "linear.cpp",
    "linear_int4.cpp",
    "linear_int4_wide.cpp",
    "linear_int8.cpp",
    "decode_layer.cpp",
    "gguf_blocks.cpp",
    "gguf_gemm.cpp",
    "dequant.cpp",
    "linear_int8_gemm.cpp",
    "gguf_x16.cpp",
)
HEADERS = (
    "convert.h",
    "gguf_formats.h",
    "gguf_kdot.h",
    "gguf_x16.h",
    "gguf_x16_avx2.h",
    "gguf_x16_pack.h",
    "int_dot.h",
    "linear_amx.h",
    "linear_broadcast.h",
    "linear_kblock.h",
    "ops.h",
)
# no FP exceptions or errno to honour: lets comparisons and conversions vectorize (NaN and inf still IEEE)
CFLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-std=c++20")
MAX_ISA_ENV = "TOKENMILL_MAX_ISA"
TORCH_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # torch's own caps, read when torch starts
# a cap -> (the target flags it compiles with, the prefixes of /proc/cpuinfo flags it takes away)
ISA_CAPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("-march=x86-64-v3", "-mtune=native"), ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")),
    "avx512": (("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"), ("amx",)),
}
LIBRARY = "tokenmill_cpu"
# the headers every source includes, parsed once into a precompiled header (gcc's .gch) for the build
PRELUDE = ("ATen/Parallel.h", "ATen/core/Tensor.h", "torch/library.h")
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what every native kernel runs


@dataclass(frozen=True)
class CpuKernels:
    """The loaded ops (`torch.ops.tokenmill_cpu`) and the folder their build lives in."""

    ops: Any
    build_dir: Path


def max_isa() -> str | None:
    """The cap `TOKENMILL_MAX_ISA` sets (`avx2`, `avx512`), None when unset or empty; another value is a
    ValueError naming the variable."""
    cap = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if cap and cap not in ISA_CAPS:
        raise ValueError(f"{MAX_ISA_ENV}: expected one of {', '.join(ISA_CAPS)} (or unset), got {cap!r}")
    return cap or None


def isa_cap_settings() -> dict[str, str]:
    """The ISA caps this process runs under, tokenmill's and torch's (the variables set), for a record."""
    return {v: os.environ[v] for v in (MAX_ISA_ENV, *TORCH_ISA_ENV) if v in os.environ}


def cpu_flags(capped: bool = True) -> str:
    """The CPU's instruction-set flags (Linux: /proc/cpuinfo), less what `TOKENMILL_MAX_ISA` takes away
    unless `capped` is False, or the best description there is."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return capped_flags(line.split(":", 1)[1], max_isa() if capped else None)
    return f"{platform.machine()} {platform.processor()}"


def capped_flags(flags: str, cap: str | None) -> str:
    """`flags` (space-separated) sorted, less those the cap takes away."""
    dropped = ISA_CAPS[cap][1] if cap else ()
    return " ".join(sorted(f for f in flags.split() if not f.startswith(dropped)))


def compile_flags() -> tuple[str, ...]:
    """The compiler's flags: CFLAGS and the target, the CPU at hand (`-march=native`) or the cap's."""
    cap = max_isa()
    return CFLAGS + (ISA_CAPS[cap][0] if cap else ("-march=native",))


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def sources_hash(csrc: Path | None = None) -> str:
    """Hash of the kernels' sources alone."""
    csrc = csrc or Path(__file__).with_name("csrc")
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((csrc / name).read_bytes())
    return h.hexdigest()[:16]


def build_key(csrc: Path) -> str:
    """Hash of what the binary depends on; a different CPU, compiler, torch or source gets a new build."""
    h = hashlib.sha256()
    for part in (cpu_flags(), _compiler_version(), torch.__version__, " ".join(compile_flags()), sources_hash(csrc)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return cache_home() / "kernels"


def _ops_loaded() -> bool:
    return hasattr(torch.ops, LIBRARY) and hasattr(getattr(torch.ops, LIBRARY), "paged_attention")


def load_cpu_kernels() -> CpuKernels | None:
    """The native CPU kernels for this CPU, built on first use; None (logged) when they cannot be built.
    A build that failed is not tried again by the same process (a compile can take a minute)."""
    csrc = Path(__file__).with_name("csrc")
    max_isa()  # a bad TOKENMILL_MAX_ISA is an error to see, not a reason to run the reference ops
    try:
        build_dir = cache_root() / build_key(csrc)
    except Exception as exc:  # (no compiler to name in the key, say)
        return _unavailable(f"{type(exc).__name__}: {exc}")
    attempt = _load_once(csrc, build_dir)
    return attempt.kernels if attempt.kernels is not None else _unavailable(attempt.error)


@dataclass(frozen=True)
class _Attempt:
    """What one process's try at loading (or building) the library in a folder came to."""

    kernels: CpuKernels | None
    error: str  # why `kernels` is None ("" when it is not)


@functools.cache
def _load_once(csrc: Path, build_dir: Path) -> _Attempt:
    try:
        if _ops_loaded():  # registered once per process; the registry is torch's, not ours
            return _Attempt(CpuKernels(getattr(torch.ops, LIBRARY), build_dir), "")
        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{LIBRARY}.so"
        if library.exists() and not (build_dir / "lock").exists():  # built, and no other process building
            torch.ops.load_library(str(library))
        else:
            _build(csrc, build_dir)
        return _Attempt(CpuKernels(getattr(torch.ops, LIBRARY), build_dir), "")
    except Exception as exc:  # any failure means: run the reference ops, and say so
        return _Attempt(None, f"{type(exc).__name__}: {exc}")


def _unavailable(error: str) -> None:
    logger.warning("native CPU kernels unavailable (%s); running the torch reference ops", error)


def require_cpu_kernels(field: str) -> CpuKernels:
    """The kernels, for a setting that asked for them by name (`field`: its name in the error)."""
    kernels = load_cpu_kernels()
    if kernels is None:
        raise ValueError(f"{field}: 'cpu' needs the native CPU kernels; they did not build here (see the log)")
    return kernels


T = TypeVar("T")


def native_choices(
    field: str, native: Callable[[CpuKernels], T], reference: Callable[[], T]
) -> dict[str, Callable[[], T]]:
    """The names a native-or-reference setting (`field`) takes: `cpu` (the native one; where the
    kernels do not build, a ValueError naming `field`), `torch` (the reference), `auto` (native where
    they build, else the reference, logged)."""

    def cpu() -> T:
        return native(require_cpu_kernels(field))

    def auto() -> T:
        kernels = load_cpu_kernels()  # logs why when it returns None
        return reference() if kernels is None else native(kernels)

    return {"auto": auto, "cpu": cpu, "torch": reference}


def choose(field: str, choices: Mapping[str, Callable[[], T]], name: str) -> T:
    """`choices[name]()`; an unknown name is a ValueError naming `field` and listing the names there are."""
    factory = choices.get(name)
    if factory is None:
        raise ValueError(f"{field}: expected one of {', '.join(sorted(choices))}, got {name!r}")
    return factory()


def _build(csrc: Path, build_dir: Path) -> None:
    """Builds and loads the library, one process at a time: a process that waited for another's build
    loads what it built. A lock file cpp_extension left behind (a build killed midway) is removed, since
    no other process can be building while this one holds the folder."""
    from torch.utils import cpp_extension

    library = build_dir / f"{LIBRARY}.so"
    with open(build_dir / "build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if library.exists():
            torch.ops.load_library(str(library))
            return
        (build_dir / "lock").unlink(missing_ok=True)
        logger.info("start-up: building the native CPU kernels for this CPU into %s (once) ...", build_dir)
        start = time.perf_counter()
        # ninja from this environment's bin folder (the `ninja` package) when it is not on PATH already
        env_bin = str(Path(sys.executable).parent)
        if env_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(csrc / name) for name in SOURCES],
            extra_cflags=list(compile_flags()) + _prelude_flags(csrc, build_dir),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(csrc)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        (build_dir / "tm_prelude.h.gch").unlink(missing_ok=True)  # hundreds of MB, needed only while building
        logger.info("start-up: native CPU kernels built: %.1f s", time.perf_counter() - start)


def _prelude_flags(csrc: Path, build_dir: Path) -> list[str]:
    """Flags that put the torch headers every source includes first in each, from a precompiled header
    made here with the build's own flags (torch's headers are most of each source's compile); [] where
    it cannot be made. A header gcc finds unusable is parsed as text instead, so this only saves time."""
    from torch.utils import cpp_extension

    header = build_dir / "tm_prelude.h"
    if any(c.isspace() for c in str(header)):
        return []  # the flag goes into a ninja command line unquoted
    header.write_text("".join(f"#include <{name}>\n" for name in PRELUDE))
    system = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    command = [
        *shlex.split(os.environ.get("CXX", "c++")),
        *(f"-D{macro}" for macro in (f"TORCH_EXTENSION_NAME={LIBRARY}", "TORCH_API_INCLUDE_EXTENSION_H")),
        f"-I{csrc}",
        *(f"-isystem{path}" for path in system),
        "-fPIC",
        "-std=c++20",
        *compile_flags(),
        "-x",
        "c++-header",
        str(header),
        "-o",
        f"{header}.gch",
    ]
    try:
        subprocess.run(command, capture_output=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("start-up: no precompiled header for the kernels' build (%s); building without", exc)
        return []
    return ["-include", str(header)]
