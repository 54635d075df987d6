"""Pure-torch reference attention over a paged KV cache; runs on CPU (and anywhere torch runs).

Decodes (one new token per sequence) are batched, in groups of similar context length, one SDPA call
per group: their cached K/V are gathered through the block tables into
[G, max_seq_len, kv_heads, head_dim] and a mask from the sequence
lengths (and the sliding window) hides the rest. (`index_select` gathers the blocks: several times
faster on CPU than advanced indexing.) Each sequence with several new tokens (a prompt
chunk) gets its own SDPA call over its own cache, so a long chunk never pads the decodes; a chunk
with nothing cached before it attends to its fresh K/V directly, causally. GQA/MQA go through
SDPA's `enable_gqa`.

The attention math runs in float32 whatever the cache dtype: it is the reference, and on CPU
torch's bfloat16 SDPA is several times slower than converting and running in float32. Inputs are
4-D: torch's CPU flash kernel takes those, 3-D ones fall back to the slow math path.

Cache layout: per layer, K and V of [num_blocks, block_size, num_kv_heads, head_dim]. The metadata
(`TorchMetadata`) is built in plain Python, then one tensor per field: a decode step has one token
per sequence, and a dozen small torch ops per step cost more than these loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import KVCache, check_batch
from tokenmill.quant.quantize import int8_rows_symmetric

# Decodes are attended in groups of this many sequences of similar context length: a few more
# kernel calls, in exchange for not padding every context to the longest one in the step.
DECODE_GROUP_SIZE = 8


@dataclass
class PrefillSequence:
    """A sequence with several new tokens this step (a prompt chunk): attended on its own."""

    row_start: int  # its first token's row in the flat batch
    query_len: int
    seq_len: int  # tokens in the cache for it after this step
    block_table: torch.Tensor  # [ceil(seq_len / block_size)] int64


@dataclass
class DecodeGroup:
    """Sequences with one new token each and contexts of similar length, attended in one batch."""

    rows: torch.Tensor  # [G] int64: their tokens' rows in the flat batch
    seq_lens: torch.Tensor  # [G] int64
    block_tables: torch.Tensor  # [G, ceil(max_seq_len / block_size)] int64
    max_seq_len: int


@dataclass
class TorchMetadata:
    num_actual_tokens: int  # tokens [0, n) of the batch are real; the rest is padding
    slot_mapping: torch.Tensor  # [n] int64: block_id * block_size + offset of each real token
    query_start_loc: torch.Tensor  # [B + 1] int64: sequence b's tokens are [qsl[b], qsl[b+1])
    # Sequences with one new token (decodes), sorted by context length and batched in groups, so that
    # a short context is not padded to the longest one in the step:
    decode_groups: list[DecodeGroup]
    # Sequences with several new tokens:
    prefills: list[PrefillSequence]


class ReferenceLayout:
    """The reference cache layout: K and V of [num_blocks, block_size, num_kv_heads, head_dim] a layer
    (an int8 cache's scales [num_blocks, block_size, num_kv_heads]); other backends may share it."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def kv_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads)


class TorchReferenceBackend(ReferenceLayout):
    name = "torch"

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> TorchMetadata:
        """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are new."""
        check_batch(query_lens, seq_lens, block_tables, block_size)
        starts = [0]
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            starts.append(starts[-1] + q)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s - q, s))
        decodes = sorted((b for b, q in enumerate(query_lens) if q == 1), key=lambda b: seq_lens[b])
        groups = [decodes[i : i + DECODE_GROUP_SIZE] for i in range(0, len(decodes), DECODE_GROUP_SIZE)]

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return TorchMetadata(
            num_actual_tokens=starts[-1],
            slot_mapping=tensor(slots),
            query_start_loc=tensor(starts),
            decode_groups=[_decode_group(g, starts, seq_lens, block_tables, block_size, tensor) for g in groups],
            prefills=[
                PrefillSequence(starts[b], q, seq_lens[b], tensor(block_tables[b][: -(-seq_lens[b] // block_size)]))
                for b, q in enumerate(query_lens)
                if q > 1
            ],
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k: torch.Tensor,  # [T, kv_heads, D]
        v: torch.Tensor,
        cache: KVCache,
        metadata: TorchMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, D]
        md = metadata
        n = md.num_actual_tokens
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        # Write only the real tokens: padding never touches the cache.
        if cache.k_scale is not None and cache.v_scale is not None:  # int8: values and per-token scales
            for values, scales, x in ((cache.k, cache.k_scale, k[:n]), (cache.v, cache.v_scale, v[:n])):
                q8, s = int8_rows_symmetric(x)
                values.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, q8)
                scales.view(-1, num_kv_heads).index_copy_(0, md.slot_mapping, s)
        else:
            cache.k.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k[:n])
            cache.v.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v[:n])

        out = q.new_zeros(q.shape)  # [T, heads, D]; padding rows stay zero
        for group in md.decode_groups:
            out[group.rows] = self._decode(q[group.rows], cache, group, scale, sliding_window)
        attend_chunks(out, q, k, v, md.prefills, lambda seq: _gather(cache, seq), scale, sliding_window)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [G, heads, D]
        cache: KVCache,
        group: DecodeGroup,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [G, heads, D]
        num_seqs, _, head_dim = q.shape
        ctx = group.max_seq_len
        blocks = group.block_tables.flatten()
        keys = _read(cache.k, cache.k_scale, blocks).view(num_seqs, -1, cache.k.shape[2], head_dim)[:, :ctx]
        values = _read(cache.v, cache.v_scale, blocks).view(num_seqs, -1, cache.v.shape[2], head_dim)[:, :ctx]
        key_pos = torch.arange(ctx, device=q.device)
        lens = group.seq_lens[:, None]  # [G, 1]; the query sits at position len - 1
        mask = key_pos < lens  # [G, ctx]
        if sliding_window is not None:
            mask &= key_pos > lens - 1 - sliding_window
        out = F.scaled_dot_product_attention(
            q[:, :, None].float(),  # [G, heads, 1, D]
            keys.transpose(1, 2).float(),  # [G, kv_heads, ctx, D]
            values.transpose(1, 2).float(),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0].to(q.dtype)


def _decode_group(
    members: list[int],
    starts: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    tensor: Callable[[list[int] | list[list[int]]], torch.Tensor],
) -> DecodeGroup:
    longest = max(seq_lens[b] for b in members)
    blocks = -(-longest // block_size)
    return DecodeGroup(
        rows=tensor([starts[b] for b in members]),
        seq_lens=tensor([seq_lens[b] for b in members]),
        # shorter tables padded with block 0: the mask hides those positions
        block_tables=tensor([(tables[b] + [0] * blocks)[:blocks] for b in members]),
        max_seq_len=longest,
    )


def _read(values: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's blocks [len(blocks), block_size, kv_heads, D]; an int8 cache's dequantized (float32)."""
    picked = values.index_select(0, blocks)
    return picked if scales is None else picked.float() * scales.index_select(0, blocks)[..., None]


def _gather(cache: KVCache, seq: PrefillSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values [seq_len, kv_heads, D] from the reference layout."""
    keys = _read(cache.k, cache.k_scale, seq.block_table).flatten(0, 1)[: seq.seq_len]
    values = _read(cache.v, cache.v_scale, seq.block_table).flatten(0, 1)[: seq.seq_len]
    return keys, values


def attend_chunks(
    out: torch.Tensor,  # [T, heads, D]: each chunk's rows are written
    q: torch.Tensor,  # [T, heads, D]
    k: torch.Tensor,  # [T, kv_heads, D]: this step's fresh keys and values
    v: torch.Tensor,
    chunks: list[PrefillSequence],
    gather: Callable[[PrefillSequence], tuple[torch.Tensor, torch.Tensor]],  # a sequence's cached K, V
    scale: float,
    sliding_window: int | None,
) -> None:
    """Each prompt chunk attended with SDPA, over its own fresh K/V when nothing was cached before it
    (no gather), else over what `gather` reads from the cache (in the backend's layout)."""
    for seq in chunks:
        rows = slice(seq.row_start, seq.row_start + seq.query_len)
        keys, values = (k[rows], v[rows]) if seq.seq_len == seq.query_len else gather(seq)
        out[rows] = attend_chunk(q[rows], keys, values, scale, sliding_window)


def attend_chunk(
    q: torch.Tensor,  # [L, heads, D]: the chunk's queries, the last L of its sequence's ctx tokens
    keys: torch.Tensor,  # [ctx, kv_heads, D]: every key of the sequence so far, the chunk's included
    values: torch.Tensor,  # [ctx, kv_heads, D]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [L, heads, D]
    """A prompt chunk's queries over its sequence's keys and values, causally (and windowed)."""
    length, ctx = q.shape[0], keys.shape[0]
    mask = None
    if sliding_window is not None or ctx != length:
        q_pos = torch.arange(ctx - length, ctx, device=q.device)[:, None]  # [L, 1]
        key_pos = torch.arange(ctx, device=q.device)  # [ctx]
        mask = key_pos <= q_pos  # [L, ctx]
        if sliding_window is not None:
            mask &= key_pos > q_pos - sliding_window
    # In the model's dtype where the cache holds it (torch's CPU flash kernel sums in float32 either
    # way, as transformers' own SDPA path runs it): at 128 / 512 tokens of the peer model's heads in
    # bfloat16 94 / 837 us against 232 / 3,386 with the inputs widened to float32 first. An int8
    # cache's dequantized keys are float32: then everything is.
    dtype = q.dtype if keys.dtype == q.dtype else torch.float32
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype),  # [1, heads, L, D]
        keys.transpose(0, 1)[None].to(dtype),  # [1, kv_heads, ctx, D]
        values.transpose(0, 1)[None].to(dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(q.dtype)
