"""Attention over a paged KV cache: the seam every attention backend plugs into.

Owns `KVCache` (one layer's paged K and V, in the layout its backend chose), the `AttentionBackend`
protocol and the one thing every backend's metadata has in common (`AttentionMetadata`). A backend
owns the rest: the shape of its cache blocks, the metadata it derives from a step's sequences
(query and sequence lengths, block tables) and the kernels that write the new tokens' K/V and
attend. The metadata is built once per step by the runner and passed to `forward()` as an
argument, never through a global.

Layout of a flat batch: the tokens of sequence 0, then of sequence 1, ...; then optional padding up
to a fixed size. Padding tokens are computed but never written to the cache, and their outputs are
meaningless.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class KVCache:
    """One layer's paged cache: k and v in the layout `AttentionBackend.kv_cache_shape` gives. An int8
    cache (`--kv-cache-dtype int8`) also holds each token's per-head scales in the layout
    `kv_scale_shape` gives: K (and V) of a token and head ~ int8 values x its scale (max |x| / 127)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # float32, int8 caches only
    v_scale: torch.Tensor | None = None


class AttentionMetadata(Protocol):
    """What every backend's per-step metadata carries; the rest is the backend's own."""

    num_actual_tokens: int  # tokens [0, n) of the flat batch are real; the rest is padding


class MetadataBuilder(Protocol):
    """What builds a step's attention metadata: a backend, or the CUDA graphs' static buffers
    (runner/cuda_graphs.py) for the steps they replay."""

    def build_metadata(
        self,
        query_lens: list[int],  # new tokens of each sequence this step
        seq_lens: list[int],  # tokens in the cache for each sequence after this step
        block_tables: list[list[int]],  # each holds at least ceil(seq_lens[b] / block_size) block ids
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata: ...


class AttentionBackend(MetadataBuilder, Protocol):
    """Writes the new tokens' K/V into the paged cache and attends over each sequence's cache (its
    per-step metadata built by `build_metadata`)."""

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (and of its V) for `num_blocks` blocks."""
        ...

    def kv_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) scales of an int8 cache: one per token and KV head."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim] (T >= num_actual_tokens: padded batch)
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: KVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def allocate_kv_cache(
    backend: AttentionBackend,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One zeroed KVCache per layer, in the backend's layout; `dtype` int8: with per-token scales."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def layer() -> KVCache:
        k, v = zeros(shape, dtype, device), zeros(shape, dtype, device)
        if dtype != torch.int8:
            return KVCache(k, v)
        scales = backend.kv_scale_shape(num_blocks, block_size, num_kv_heads)
        return KVCache(k, v, zeros(scales, torch.float32, device), zeros(scales, torch.float32, device))

    return [layer() for _ in range(num_layers)]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor; on the CPU, anonymous memory the kernel maps as zero pages on first touch
    (`torch.frombuffer`: the tensor keeps the mapping alive), so a cache of gigabytes costs nothing at
    start (`torch.zeros` writes every page) and each page is faulted in as requests first fill it. The
    mapping is kept on 4 KB pages (MADV_NOHUGEPAGE where there is one): a 2 MB page met for the first
    time inside a step can stall it (runner/huge_pages.py)."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, numel * dtype.itemsize)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def check_batch(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    """The invariants every backend's `build_metadata` relies on; a ValueError names the first broken one."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 < q <= s:
            raise ValueError(f"query_lens[{b}]={q} must be in [1, seq_lens[{b}]={s}]")
        if len(table) * block_size < s:
            raise ValueError(f"block_tables[{b}] holds {len(table)} blocks, too few for {s} tokens")
