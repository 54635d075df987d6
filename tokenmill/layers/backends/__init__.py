"""The attention backends by name: `attention_backend` in EngineConfig (`--attention-backend`) picks one.

`torch` is the reference (pure torch, runs wherever torch runs). Faster CPU kernels and GPU kernels
register here beside it; every registered backend runs the engine's core test cases.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend

_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
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
