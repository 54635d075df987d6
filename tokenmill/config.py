"""EngineConfig: every engine setting in one validated, frozen dataclass.

Bad values raise a ValueError naming the field. Derived sizes (the KV cache's blocks, the
effective maximum model length) are computed once by the engine from this and the model.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING = ("continuous", "static")
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3  # bytes
GPU_MEMORY_FRACTION = 0.9  # of free memory after loading the model


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None  # bytes; None: 2 GiB on CPU, 90% of free memory on GPU
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    scheduling: str = "continuous"
    seed: int = 0  # draws the seeds of requests that bring none
    enable_prefix_caching: bool = True  # share the KV of common prompt prefixes across requests

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive(name)
        for name in ("kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                positive(name)
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling: expected one of {', '.join(SCHEDULING)}, got {self.scheduling!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected one of float32, bfloat16, float16 or 'auto', got {self.dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching: expected a boolean, got {self.enable_prefix_caching!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
