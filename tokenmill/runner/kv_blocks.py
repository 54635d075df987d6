"""KVBlocks: a request's KV cache blocks copied out of one engine's paged cache and into another's.

Every tensor of every layer's `KVCache` (K, V, and an int8 cache's scales) has the blocks as its
first dimension, whatever the attention backend's layout; a copy takes the same block rows of each,
in order, as raw bytes (so any dtype travels, bfloat16 included) in one contiguous uint8 array with
its layout beside it. Both engines must hold the same model with the same block size, backend and KV
dtype: `check` says which of these differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.attention import KVCache


@dataclass
class KVBlocks:
    num_blocks: int
    num_tokens: int  # tokens of KV the blocks hold (the last block may be partly filled)
    layout: list[tuple[str, tuple[int, ...]]]  # per cache tensor: its dtype and one block's shape
    data: np.ndarray  # uint8 [total bytes]: each tensor's block rows [num_blocks, *shape], in order

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _tensors(caches: list[KVCache]) -> list[torch.Tensor]:
    out = []
    for cache in caches:
        out += [cache.k, cache.v]
        if cache.k_scale is not None and cache.v_scale is not None:
            out += [cache.k_scale, cache.v_scale]
    return out


def layout_of(caches: list[KVCache]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for t in _tensors(caches)]


def read_blocks(caches: list[KVCache], block_ids: list[int], num_tokens: int) -> KVBlocks:
    """Copy these blocks of every cache tensor out (CPU memory)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0].k.device)
    parts = [t.index_select(0, index).contiguous().view(torch.uint8).reshape(-1).cpu() for t in _tensors(caches)]
    data = torch.cat(parts).numpy() if parts else np.zeros(0, dtype=np.uint8)
    return KVBlocks(len(block_ids), num_tokens, layout_of(caches), data)


def write_blocks(caches: list[KVCache], blocks: KVBlocks, first_block: int, block_ids: list[int]) -> None:
    """Write blocks [first_block, first_block + len(block_ids)) of `blocks` into these cache blocks."""
    if first_block + len(block_ids) > blocks.num_blocks:
        raise ValueError(f"block_ids: {len(block_ids)} blocks from {first_block}, the copy holds {blocks.num_blocks}")
    data = torch.from_numpy(blocks.data)
    offset = 0
    device = caches[0].k.device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    for t in _tensors(caches):
        row_bytes = t[0].numel() * t.element_size()
        size = blocks.num_blocks * row_bytes
        part = data[offset : offset + size].view(blocks.num_blocks, row_bytes)[
            first_block : first_block + len(block_ids)
        ]
        t.view(t.shape[0], -1).view(torch.uint8).index_copy_(0, index, part.to(device))
        offset += size


def check(caches: list[KVCache], blocks: KVBlocks) -> str | None:
    """Why `blocks` cannot go into these caches (another model, dtype, block size...), or None."""
    mine = layout_of(caches)
    if [(d, tuple(s)) for d, s in blocks.layout] != mine:
        return f"the KV layouts differ (received {blocks.layout[:2]}..., this engine's {mine[:2]}...)"
    return None
