"""Sizing the paged KV cache: bytes per block in the backend's layout, and the memory budget."""

from __future__ import annotations

import math

import torch

from tokenmill.layers.attention import AttentionBackend
from tokenmill.models.config import ModelConfig


def kv_bytes_per_block(backend: AttentionBackend, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V), in the backend's layout; an int8 cache's
    float32 scales (one per token and KV head) included."""
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = math.prod(backend.kv_cache_shape(1, block_size, cfg.num_kv_heads, cfg.head_dim)) * element
    if dtype == torch.int8:
        per_layer += math.prod(backend.kv_scale_shape(1, block_size, cfg.num_kv_heads)) * 4
    return 2 * cfg.num_layers * per_layer


def kv_cache_budget(
    device: torch.device, configured: int | None, cpu_default: int, gpu_fraction: float, peak_bytes: int
) -> int:
    """Bytes for the KV cache: as configured; else the CPU default; else, on a GPU, `gpu_fraction` of
    its memory less what the model and the warm-up's peak took (`peak_bytes`)."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return max(0, int(total * gpu_fraction) - peak_bytes)
    return cpu_default
