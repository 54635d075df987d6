"""GGUF's Q8_0, Q4_0 and Q4_1 blocks read as they are into tokenmill's quantized weight formats.

Owns the byte layout of those three block types (ggml's `block_q8_0`, `block_q4_0`, `block_q4_1`:
32 weights a block, a float16 scale first) and its mapping onto `Int8Weight` / `Int4Weight`
(quant/quantize.py), which hold the same grids exactly:
- Q8_0 (34 bytes: scale d, 32 int8 q): W = d * q -> int8 in groups of 32, scale d;
- Q4_0 (18 bytes: d, 16 bytes of nibbles): W = d * (q - 8) -> int4, scale d, minimum -8 d (exact:
  a power-of-two multiple of a float16);
- Q4_1 (20 bytes: d, then the minimum m, 16 bytes of nibbles): W = d * q + m -> int4, scale d, minimum m.
In a block's nibble bytes, byte j holds weight j (low nibble) and weight 16 + j (high nibble).
Rows arrive as GGUF stores a matrix: [N, K / 32 * block bytes] uint8. `decode` returns the values
and the per-block scale and minimum as tensors, so the caller can permute rows (llama.cpp's Q/K row
order) before packing them with `pack`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.quant.quantize import Int4Weight, Int8Weight, int8_weight, pack_int4

BLOCK = 32  # weights a block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
KEPT_TYPES = tuple(BLOCK_BYTES)  # the GGUF types a model keeps quantized


@dataclass(frozen=True)
class GGUFBlocks:
    """A matrix's blocks decoded: q [N, K] (int8 for Q8_0, uint8 in 0..15 for the 4-bit types), scale and min
    [N, K / 32] (float16; min None for Q8_0)."""

    type_name: str
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None

    def permute_rows(self, order: torch.Tensor) -> GGUFBlocks:  # order [N]: new row i = old row order[i]
        mins = None if self.min is None else self.min[order]
        return GGUFBlocks(self.type_name, self.q[order], self.scale[order], mins)


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
    """raw [N, K / 32 * bytes] uint8 of a `type_name` matrix of `shape` (N, K) -> its blocks."""
    n, k = shape
    size = BLOCK_BYTES[type_name]
    if k % BLOCK or raw.dtype != np.uint8 or raw.size != n * (k // BLOCK) * size:
        raise ValueError(f"{type_name} data of {raw.size} bytes does not hold a [{n}, {k}] matrix")
    blocks = raw.reshape(n, k // BLOCK, size)
    scale = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].copy())
    if type_name == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k))  # (a copy already)
        return GGUFBlocks(type_name, q, scale, None)
    start = 2 if type_name == "Q4_0" else 4
    nibbles = blocks[..., start:]  # [N, K / 32, 16] uint8: weights j (low) and 16 + j (high)
    q = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k))  # a byte a value
    if type_name == "Q4_0":
        low = -8 * scale  # float16: exact
    else:
        low = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].copy())
    return GGUFBlocks(type_name, q, scale, low)


def pack(b: GGUFBlocks) -> Int8Weight | Int4Weight:
    """The blocks in tokenmill's format: int8 or int4, groups of 32."""
    if b.min is None:
        return int8_weight(b.q, b.scale.float(), BLOCK)
    return pack_int4(b.q, b.scale, b.min, BLOCK)
