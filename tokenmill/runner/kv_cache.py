"""The paged KV cache: sized from a memory budget; per layer K and V of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from tokenmill.layers.attention import KVCache
from tokenmill.models.config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


def num_blocks_for_memory(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    return memory_bytes // kv_bytes_per_block(cfg, block_size, dtype)


def kv_cache_budget(device: torch.device, configured: int | None, cpu_default: int, gpu_fraction: float) -> int:
    """Bytes for the KV cache: as configured, else the CPU default, else a fraction of free GPU memory."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * gpu_fraction)
    return cpu_default
