"""The attention backends by name: `attention_backend` in EngineConfig (`--attention-backend`) picks one.

`torch` is the reference (pure torch, runs wherever torch runs). `cpu` reads the paged cache in
place with a native kernel built for this CPU on first use (`kernels/cpu_build.py`). `auto` (the
default) is `cpu` where its kernels build and `torch` elsewhere (the log says which and why).
`triton` (triton_paged.py) is the GPU one: a CUDA device, or Triton's CPU interpreter (TRITON_INTERPRET=1,
for tests). Every registered backend runs the engine's core test cases.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.kernels.cpu_build import choose, native_choices
from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends.cpu_paged import CpuPagedBackend
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend


def _triton() -> AttentionBackend:
    from tokenmill.layers.backends.triton_paged import TritonPagedBackend  # (imports triton: GPU path only)

    return TritonPagedBackend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    **native_choices("attention_backend", CpuPagedBackend, TorchReferenceBackend),
    "triton": _triton,
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance by name; a ValueError lists the names there are."""
    return choose("attention_backend", _BACKENDS, name)
