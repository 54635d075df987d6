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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillSequence


class TorchReferenceBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        md = metadata
        n = md.num_actual_tokens
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        # Write only the real tokens: padding never touches the cache.
        cache.k.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k[:n])
        cache.v.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v[:n])

        out = q.new_zeros(q.shape)  # [T, heads, D]; padding rows stay zero
        for group in md.decode_groups:
            out[group.rows] = self._decode(q[group.rows], cache, group, scale, sliding_window)
        for seq in md.prefills:
            rows = slice(seq.row_start, seq.row_start + seq.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], cache, seq, scale, sliding_window)
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
        keys = cache.k.index_select(0, blocks).view(num_seqs, -1, cache.k.shape[2], head_dim)[:, :ctx]
        values = cache.v.index_select(0, blocks).view(num_seqs, -1, cache.v.shape[2], head_dim)[:, :ctx]
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

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # [L, heads, D]: the chunk's queries
        k: torch.Tensor,  # [L, kv_heads, D]: the chunk's fresh keys and values
        v: torch.Tensor,
        cache: KVCache,
        seq: PrefillSequence,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [L, heads, D]
        length, ctx = seq.query_len, seq.seq_len
        if ctx == length:  # nothing cached before this chunk: its own K/V are the whole context
            keys, values = k, v
        else:
            keys = cache.k.index_select(0, seq.block_table).flatten(0, 1)[:ctx]  # [ctx, kv_heads, D]
            values = cache.v.index_select(0, seq.block_table).flatten(0, 1)[:ctx]
        mask = None
        if sliding_window is not None or ctx != length:
            q_pos = torch.arange(ctx - length, ctx, device=q.device)[:, None]  # [L, 1]
            key_pos = torch.arange(ctx, device=q.device)  # [ctx]
            mask = key_pos <= q_pos  # [L, ctx]
            if sliding_window is not None:
                mask &= key_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),  # [1, heads, L, D]
            keys.transpose(0, 1)[None].float(),  # [1, kv_heads, ctx, D]
            values.transpose(0, 1)[None].float(),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).to(q.dtype)
