"""Weight quantization math: dense weights to int8 / int4 and back, and how group sizes are chosen.

Owns the formats the quantized linear methods (quant/int_methods.py) hold, as plain dataclasses:
- `Int8Weight`: symmetric int8, q in [-127, 127], W[n, k] ~ q[n, k] * scales[n, k // group]; `group`
  is the input width (one scale per output row, "per channel") or a power of two from 32 (per group:
  llama.cpp's Q8_0 grid is group 32). `wsums` (each row's sum of q) serves the W8A8 kernel.
- `Int4Weight`: asymmetric int4 in groups of `group` along the input, q in [0, 15] (the group's
  range in 15 steps from its minimum), W[n, k] ~ q[n, k] * scale + min, in tokenmill's packed layout;
  `Int4PackWeight` holds the same values in torch's CPU int4 layout ((q - 8) * scale + zero, zero =
  min + 8 * scale, in bfloat16), for torch's int4 kernel where tokenmill's do not build.
- `quantize_q8_0` / `quantize_q4_1`: int8 in GGUF's Q8_0 blocks (groups of 32, a float16 scale each,
  the bytes a GGUF file stores), int4's grid in Q4_1's blocks, for `--quantization int8` / `int4` kept
  in blocks (quant/int_blocks.py).
Quantization rounds to nearest; the dequantized weights (`dequantize`) are the reference every kernel
is tested against. `choose_group` applies the user's group size to one layer's input width: a group
that does not divide it is an error naming the layer, or, with fallback, the largest power of two
from 32 below it that divides.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

MIN_GROUP = 32
INT4_ROWS = 64  # torch's CPU int4 layout takes output rows in multiples of this many


@dataclass(frozen=True)
class QuantSpec:
    """What the user asked for: the method (`int8`, `int4`, `w8a8`), the group size (None: per
    channel for int8 and w8a8, 32 for int4), whether a group that does not divide a layer's input
    width falls back to one that does (else it is an error), and the output projection's method."""

    method: str
    group_size: int | None = None
    group_fallback: bool = False
    head: str = "same"  # the output projection: "same" as the layers, or "int8" (per channel)


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // group] float32
    group: int
    wsums: torch.Tensor  # [N] int32: each row's sum of q

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.wsums))


TILE = 16  # weight rows an int4 tile interleaves (kernels/csrc/linear_int4.cpp)


@dataclass(frozen=True)
class Int4Weight:
    """int4 in tokenmill's layout (kernels/csrc/linear_int4.cpp): W[n, k] ~ q * scale + min of (n, k // group).

    Rows in tiles of TILE (the last padded with zero rows): in tile t, chunk c (k 8c .. 8c + 7) is 64
    bytes, byte 4i + j holding row 16t + i's k = 8c + j in its low nibble and 8c + 4 + j in its high one,
    so one 64-byte load gives 4 consecutive k of 16 rows in each nibble half: a dot-product lane a row.
    Scales and mins tile the same way, [tile, group, row in tile]."""

    packed: torch.Tensor  # [T, K / 8, 64] uint8, T = ceil(rows / TILE)
    scales: torch.Tensor  # [T, K / group, TILE] float16 (float32 for a checkpoint's that float16 would round)
    mins: torch.Tensor  # [T, K / group, TILE] float16 (float32 for checkpoints' -zero * scale)
    group: int
    rows: int  # N: the tiles' rows past it are padding

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.packed.shape[1] * 8

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))


@dataclass(frozen=True)
class Int4PackWeight:
    """int4 in torch's CPU int4 layout, for its kernel (where tokenmill's kernels do not build):
    W[n, k] ~ (q - 8) * scale + zero, (scale, zero) per group in bfloat16."""

    packed: torch.Tensor  # torch's layout of q [N, K] (uint8, two values a byte)
    scales_zeros: torch.Tensor  # [K / group, N, 2] (scale, zero), bfloat16
    group: int
    shape: tuple[int, int]  # (N, K)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def choose_group(spec: QuantSpec, in_features: int, layer: str) -> int:
    """The group size `spec` gives a layer of input width `in_features` (`layer` names it in errors)."""
    if spec.group_size is None:
        return in_features if spec.method != "int4" else MIN_GROUP
    group = spec.group_size
    if group < MIN_GROUP or group & (group - 1):
        raise ValueError(f"quantization_group_size: expected a power of two from {MIN_GROUP}, got {group}")
    if spec.method == "w8a8":
        raise ValueError("quantization_group_size: w8a8 quantizes per output channel only; leave it unset")
    if in_features % group == 0:
        return group
    if spec.group_fallback:
        while group > MIN_GROUP and in_features % group:
            group //= 2
        if in_features % group == 0:
            return group
    hint = "" if spec.group_fallback else "; pass quantization_group_fallback to use the largest that divides"
    raise ValueError(
        f"quantization_group_size: {spec.group_size} does not divide the input width {in_features} of {layer}{hint}"
    )


def int8_rows_symmetric(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [...]): each row over its last dimension, scale
    max |x| / 127 (0 for a row of zeros), rounding half to even as the native kernels do. W8A8's
    activations (without the native kernels) and the int8 KV cache's reference write."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[..., None]).to(torch.int8), amax / 127


def quantize_int8(w: torch.Tensor, group: int) -> Int8Weight:
    """w [N, K] (any float dtype) -> symmetric int8 with one scale per `group` inputs of a row."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group)
    for start, g in _row_blocks(w, group):  # g [rows, K / group, group] float32, a copy to work in
        lo, hi = g.amin(-1), g.amax(-1)  # (two vectorized passes: torch's aminmax is a scalar loop)
        s = torch.maximum(-lo, hi) / 127  # [rows, K / group]: the largest magnitude over 127
        g.div_(s.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(-127, 127)
        q[start : start + len(g)] = g.reshape(len(g), k)
        scales[start : start + len(g)] = s
    return int8_weight(q, scales, group)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (any float dtype, K a multiple of 32) -> GGUF's Q8_0 blocks [N, K / 32 * 34] uint8: per 32
    inputs a float16 scale d = max |w| / 127 (little-endian), then 32 int8 q = w / d rounded half away
    from zero, as llama.cpp's and the `gguf` package's quantizers compute them (q from the float32 d,
    the stored d rounded to float16)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantize_q8_0: Q8_0 blocks hold 32 weights; a row of {k} is not a whole number of them")
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    for start, g in _row_blocks(w, 32):  # g [rows, K / 32, 32] float32
        rows = len(g)
        d = torch.maximum(-g.amin(-1), g.amax(-1)) / 127  # [rows, K / 32]
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        g.mul_(inv[..., None])
        q = torch.round(g)  # half to even: the ties go away from zero below
        ties = (g - g.trunc()).abs() == 0.5
        q = torch.where(ties, g.trunc() + g.sign(), q)
        block = out[start : start + rows]
        block[..., :2] = d.to(torch.float16).view(torch.uint8).reshape(rows, -1, 2)
        block[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(n, k // 32 * 34)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K a multiple of 32) -> tokenmill's int4 grid in groups of 32 (`quantize_int4`'s values:
    a float16 scale and minimum a group) as GGUF's Q4_1 blocks [N, K / 32 * 20] uint8: the scale d and
    the minimum m (float16, little-endian), then 16 bytes, byte j holding weight j in its low nibble and
    weight j + 16 in its high one; W = q * d + m."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantize_q4_1: Q4_1 blocks hold 32 weights; a row of {k} is not a whole number of them")
    q, scale, lo = int4_grid(w, 32)  # q [N, K] uint8, scale / lo [N, K / 32] (float16 values)
    mins = ((lo + 8 * scale) - 8 * scale).half()  # (as `quantize_int4` keeps them)
    runs = q.view(n, k // 32, 32)
    out = torch.empty(n, k // 32, 20, dtype=torch.uint8)
    out[..., 0:2] = scale.half().view(torch.uint8).reshape(n, -1, 2)
    out[..., 2:4] = mins.view(torch.uint8).reshape(n, -1, 2)
    out[..., 4:] = runs[..., :16] | (runs[..., 16:] << 4)
    return out.reshape(n, k // 32 * 20)


# rows quantized at a time: their float32 copy (8 MB at 2,048 inputs) stays in a server CPU's L3, and
# few enough blocks that each op's thread start-up stays small (on a busy machine every parallel op
# waits for its threads to be scheduled: 128-row blocks spent most of a 1.1B model's quantizing there)
QUANTIZE_ROWS = 1024


def _row_blocks(w: torch.Tensor, group: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, a float32 copy of `QUANTIZE_ROWS` rows of w [N, K] as [rows, K / group, group]):
    the quantizers' passes (range, divide, round, clamp) run in place over a block that stays in the
    CPU's cache, instead of each pass over the whole matrix in memory."""
    n, k = w.shape
    for start in range(0, n, QUANTIZE_ROWS):
        block = w[start : start + QUANTIZE_ROWS].to(torch.float32, copy=True)
        yield start, block.reshape(-1, k // group, group)


def dequantize_int8(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:  # -> [N, K]
    n, k = w.q.shape
    g = w.q.float().reshape(n, k // w.group, w.group) * w.scales[..., None]
    return g.reshape(n, k).to(dtype)


def int4_values(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in 0..15 as int32, scale [N, K / group], zero [N, K / group]) (float32),
    with W ~ (q - 8) * scale + zero (`int4_grid`'s values)."""
    q, scale, lo = int4_grid(w, group)
    return q.to(torch.int32), scale, lo + 8 * scale


def int4_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in 0..15 as uint8, scale [N, K / group], lo [N, K / group]) (float32),
    with W ~ q * scale + lo. Each group's scale and minimum are rounded to float16 first (the grid
    GGUF's Q4_1 stores, and what tokenmill's layout keeps), q rounded against them."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    q8 = q.view(torch.int8)  # the same bytes: 0..15 either way
    scale, lo = torch.empty(n, k // group), torch.empty(n, k // group)
    for start, g in _row_blocks(w, group):  # g [rows, K / group, group]
        low, high = g.amin(-1), g.amax(-1)
        s = ((high - low) / 15).half().float()
        low = low.half().float()
        g.sub_(low[..., None]).div_(s.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(0, 15)
        q8[start : start + len(g)] = g.reshape(len(g), k)  # (float to int8 is vectorized, float to uint8 not)
        scale[start : start + len(g)], lo[start : start + len(g)] = s, low
    return q, scale, lo


def quantize_int4(w: torch.Tensor, group: int) -> Int4Weight:
    """w [N, K] (K a multiple of 32) -> asymmetric int4 in groups of `group`, tokenmill's layout."""
    q, scale, lo = int4_grid(w, group)
    mins = (lo + 8 * scale) - 8 * scale  # W ~ q * scale + min (as the zero point's round trip gives it)
    return pack_int4(q, scale.half(), mins.half(), group)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> Int4Weight:
    """Values q [N, K] in 0..15 (K a multiple of 32), scales and mins [N, K / group] (float16 or float32)
    -> tokenmill's layout, W = q * scale + min."""
    n, k = q.shape
    tiles = -(-n // TILE)
    pad = tiles * TILE - n
    if pad:  # zero rows: their products are 0 and never stored
        q = F.pad(q, (0, 0, 0, pad))
        scales, mins = F.pad(scales, (0, 0, 0, pad)), F.pad(mins, (0, 0, 0, pad))
    # each row's chunk of 8 values as one little-endian int64: bytes 0-3 (k 8c .. 8c + 3) in its low word,
    # bytes 4-7 in its high one; low word | high word << 4 puts each of the high ones in the high nibble of
    # the byte its low partner holds (a value under 16 never carries into the next byte)
    v = q.to(torch.uint8).contiguous().view(torch.int64).view(tiles, TILE, k // 8)  # [tile, row, chunk]
    words = ((v & 0xFFFFFFFF) | ((v >> 32) << 4)).view(torch.int32)[..., ::2]  # the low words (little-endian)
    packed = words.transpose(1, 2).contiguous().view(torch.uint8).view(tiles, k // 8, 64)
    return Int4Weight(packed, _tiled(scales, tiles), _tiled(mins, tiles), group, n)


def _tiled(values: torch.Tensor, tiles: int) -> torch.Tensor:  # [T * TILE, G] -> [T, G, TILE]
    return values.reshape(tiles, TILE, -1).transpose(1, 2).contiguous()


def int4_scales(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, mins), each [N, K / group] in their stored dtype."""
    return tuple(t.transpose(1, 2).reshape(-1, t.shape[1])[: w.rows] for t in (w.scales, w.mins))  # type: ignore[return-value]


def int8_weight(q: torch.Tensor, scales: torch.Tensor, group: int) -> Int8Weight:
    """q [N, K] int8 with its scales [N, K / group] (float32) as an `Int8Weight`."""
    return Int8Weight(q.contiguous(), scales.float().contiguous(), group, q.sum(1, dtype=torch.int32))


def concat_rows(parts: list[Int8Weight] | list[Int4Weight]) -> Int8Weight | Int4Weight:
    """Quantized weights of one input width and group stacked along the output rows (a fused
    layer's shards, in order)."""
    first = parts[0]
    if any(type(p) is not type(first) or p.group != first.group for p in parts):
        raise ValueError("the shards of one layer must share a format and a group size")
    if isinstance(first, Int8Weight):
        int8 = cast(list[Int8Weight], parts)
        return Int8Weight(
            torch.cat([p.q for p in int8]), torch.cat([p.scales for p in int8]), first.group,
            torch.cat([p.wsums for p in int8]),
        )  # fmt: skip
    int4 = cast(list[Int4Weight], parts)
    if all(p.rows % TILE == 0 for p in int4):  # whole tiles: stacked as they are
        return Int4Weight(
            torch.cat([p.packed for p in int4]), torch.cat([p.scales for p in int4]), torch.cat([p.mins for p in int4]),
            first.group, sum(p.rows for p in int4),
        )  # fmt: skip
    scales, mins = zip(*(int4_scales(p) for p in int4), strict=True)
    return pack_int4(torch.cat([unpack_int4(p) for p in int4]), torch.cat(scales), torch.cat(mins), first.group)


def unpack_int4(w: Int4Weight) -> torch.Tensor:  # -> q [N, K] int32 in 0..15
    return _unpack_bytes(w.packed.view(w.packed.shape[0], -1, TILE, 4).transpose(1, 2)).reshape(-1, w.shape[1])[
        : w.rows
    ]


def _unpack_bytes(b: torch.Tensor) -> torch.Tensor:  # [..., K / 8, 4] uint8 -> [..., K / 8, 8] int32 in k order
    b = b.to(torch.int32)
    return torch.cat([b & 15, b >> 4], dim=-1)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:  # -> [N, K]
    n, k = w.shape
    scales, mins = int4_scales(w)
    q = unpack_int4(w).float().reshape(n, k // w.group, w.group)
    g = q * scales.float()[..., None] + mins.float()[..., None]
    return g.reshape(n, k).to(dtype)


def quantize_int4pack(w: torch.Tensor, group: int) -> Int4PackWeight:
    """w [N, K] (N a multiple of 64) -> asymmetric int4 in groups of `group`, packed for torch's CPU
    int4 kernel."""
    n, k = w.shape
    if n % INT4_ROWS:
        raise ValueError(f"int4 packs output rows {INT4_ROWS} at a time; this layer has {n}")
    q, scale, zero = int4_values(w, group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    # [K / group, N, 2] in bfloat16, the one activation dtype torch's CPU kernel runs fast
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4PackWeight(packed, scales_zeros, group, (n, k))


@functools.cache
def int4pack_block() -> int:
    """How many output rows torch's CPU int4 packing interleaves on this CPU: its layout follows the
    vector width it was built for (64 rows with AVX-512, 32 with AVX2). Read off the packing op once,
    on a matrix whose rows are told apart by their values."""
    q = (torch.arange(INT4_ROWS, dtype=torch.int32)[:, None] % 16).expand(INT4_ROWS, 16).contiguous()
    q = q ^ (torch.arange(INT4_ROWS, dtype=torch.int32)[:, None] // 16)  # rows j and j + 16 differ too
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for block in (INT4_ROWS, INT4_ROWS // 2):
        if torch.equal(_unpack_blocks(packed, INT4_ROWS, 16, block), q):
            return block
    raise RuntimeError("torch's CPU int4 layout is neither of the two known ones")


def _unpack_blocks(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:  # -> [n, k] int32
    b = packed.reshape(n // block, k, block // 2)
    return torch.cat([b & 15, b >> 4], -1).permute(0, 2, 1).reshape(n, k).to(torch.int32)


def unpack_int4pack(w: Int4PackWeight) -> torch.Tensor:  # -> q [N, K] int32 in 0..15
    """The values torch's CPU int4 layout holds: per block of B output rows (`int4pack_block`), for
    each input k, B / 2 bytes, byte j holding row j (low nibble) and row B / 2 + j (high nibble).
    Checked against the packing op by the tests (torch is pinned)."""
    n, k = w.shape
    return _unpack_blocks(w.packed, n, k, int4pack_block())


def dequantize_int4pack(w: Int4PackWeight, dtype: torch.dtype) -> torch.Tensor:  # -> [N, K]
    n, k = w.shape
    scale = w.scales_zeros[..., 0].t().float()  # [N, K / group]
    zero = w.scales_zeros[..., 1].t().float()
    g = (unpack_int4pack(w).float().reshape(n, k // w.group, w.group) - 8) * scale[..., None] + zero[..., None]
    return g.reshape(n, k).to(dtype)


def int8_rows(w: Int8Weight, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, K] float32
    """Rows `ids` of the weights `w` stands for (a tied embedding table read from its quantized head)."""
    k = w.q.shape[1]
    rows = w.q.index_select(0, ids).float().view(-1, k // w.group, w.group)
    return (rows * w.scales.index_select(0, ids)[..., None]).view(-1, k)


def int4_rows(w: Int4Weight, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, K] float32
    k = w.shape[1]
    tiles, lanes = ids // TILE, ids % TILE
    q = _unpack_bytes(w.packed.view(w.packed.shape[0], -1, TILE, 4)[tiles, :, lanes]).view(-1, k // w.group, w.group)
    scales, mins = w.scales[tiles, :, lanes].float(), w.mins[tiles, :, lanes].float()  # [T, K / group]
    return (q.float() * scales[..., None] + mins[..., None]).view(-1, k)


def int4pack_rows(w: Int4PackWeight, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, K] float32
    """Rows of torch's layout: row n is byte (n % B) % (B / 2) of its block's B / 2 per k, the high
    nibble from B / 2 on (B: `int4pack_block`)."""
    n, k = w.shape
    block = int4pack_block()
    blocks = w.packed.view(n // block, k, block // 2)
    within = ids % block
    b = blocks[ids // block, :, within % (block // 2)].to(torch.int32)  # [T, K]
    q = (b >> (4 * (within >= block // 2).to(torch.int32))[:, None]) & 15
    scale = w.scales_zeros[:, ids, 0].t().float()  # [T, K / group]
    zero = w.scales_zeros[:, ids, 1].t().float()
    g = (q.float().view(-1, k // w.group, w.group) - 8) * scale[..., None] + zero[..., None]
    return g.view(-1, k)
