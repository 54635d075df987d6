"""Attention over a paged KV cache: the metadata every backend reads, and the backend protocol.

Owns `KVCache` (one layer's paged K and V), `AttentionMetadata` (what a flat batch of several
sequences' tokens needs to attend: slot mapping, block tables, sequence lengths, query starts) and
`build_attention_metadata`, which derives it from per-sequence lengths and block tables. Metadata is
always passed as an argument, never through a global.

Layout of a flat batch: the tokens of sequence 0, then of sequence 1, ...; then optional padding up
to a fixed size. Padding tokens are computed but never written to the cache, and their outputs are
meaningless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

# Decodes are attended in groups of this many sequences of similar context length: a few more
# kernel calls, in exchange for not padding every context to the longest one in the step.
DECODE_GROUP_SIZE = 8


@dataclass
class KVCache:
    """One layer's paged cache. k, v: [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


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
class AttentionMetadata:
    num_actual_tokens: int  # tokens [0, n) of the batch are real; the rest is padding
    slot_mapping: torch.Tensor  # [n] int64: block_id * block_size + offset of each real token
    query_start_loc: torch.Tensor  # [B + 1] int64: sequence b's tokens are [qsl[b], qsl[b+1])
    # Sequences with one new token (decodes), sorted by context length and batched in groups, so that
    # a short context is not padded to the longest one in the step:
    decode_groups: list[DecodeGroup]
    # Sequences with several new tokens:
    prefills: list[PrefillSequence]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are new.

    `block_tables[b]` must hold at least ceil(seq_lens[b] / block_size) block ids.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 < q <= s:
            raise ValueError(f"query_lens[{b}]={q} must be in [1, seq_lens[{b}]={s}]")
        if len(table) * block_size < s:
            raise ValueError(f"block_tables[{b}] holds {len(table)} blocks, too few for {s} tokens")
    # Built in plain Python, then one tensor per field: a decode step has one token per sequence,
    # and a dozen small torch ops per step cost more than these loops.
    starts = [0]
    slots: list[int] = []
    for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(starts[-1] + q)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s - q, s))
    decodes = sorted((b for b, q in enumerate(query_lens) if q == 1), key=lambda b: seq_lens[b])
    groups = [decodes[i : i + DECODE_GROUP_SIZE] for i in range(0, len(decodes), DECODE_GROUP_SIZE)]

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionMetadata(
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


class AttentionBackend(Protocol):
    """Writes the new tokens' K/V into the paged cache and attends over each sequence's cache."""

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
