"""The attention backends by name: `attention_backend` in EngineConfig (`--attention-backend`) picks one.

`torch` is the reference (pure torch, runs wherever torch runs). `cpu` reads the paged cache in
place with a native kernel built for this CPU on first use (`kernels/cpu_build.py`). `auto` (the
default) is `cpu` where its kernels build and `torch` elsewhere (the log says which and why).
GPU kernels register here beside them; every registered backend runs the engine's core test cases.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.kernels.cpu_build import load_cpu_kernels, require_cpu_kernels
from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends.cpu_paged import CpuPagedBackend
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend


def _cpu() -> AttentionBackend:
    return CpuPagedBackend(require_cpu_kernels("attention_backend"))


def _auto() -> AttentionBackend:
    kernels = load_cpu_kernels()  # logs why when it returns None
    return TorchReferenceBackend() if kernels is None else CpuPagedBackend(kernels)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "auto": _auto,
    "cpu": _cpu,
    "torch": TorchReferenceBackend,
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance by name; a ValueError lists the names there are."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"attention_backend: expected one of {', '.join(backend_names())}, got {name!r}")
    return factory()
