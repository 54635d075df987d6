"""Pure-torch reference attention over a paged KV cache; runs on CPU (and anywhere torch runs).

One padded SDPA call per layer: each sequence's cached K/V are gathered through its block table
into [B, max_blocks * block_size, kv_heads, head_dim], the new queries are scattered into
[B, max_query_len, heads, head_dim], and a mask built from absolute positions applies causality,
sequence length and the sliding window at once. GQA/MQA go through SDPA's `enable_gqa`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import AttentionMetadata, KVCache


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

        num_seqs, max_blocks = md.block_tables.shape
        ctx = max_blocks * cache.block_size
        keys = cache.k[md.block_tables].view(num_seqs, ctx, num_kv_heads, head_dim)
        values = cache.v[md.block_tables].view(num_seqs, ctx, num_kv_heads, head_dim)

        queries = q.new_zeros(num_seqs, md.max_query_len, q.shape[1], head_dim)
        queries[md.token_seq, md.token_query_idx] = q[:n]

        key_pos = torch.arange(ctx, device=q.device)  # [ctx]
        q_pos = md.query_positions[:, :, None]  # [B, max_q, 1]
        mask = key_pos <= q_pos  # [B, max_q, ctx]; also excludes keys past the sequence's end
        if sliding_window is not None:
            mask &= key_pos > q_pos - sliding_window

        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [B, heads, max_q, D]
            keys.transpose(1, 2),  # [B, kv_heads, ctx, D]
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, max_q, heads, D]
        result = q.new_zeros(q.shape)
        result[:n] = out[md.token_seq, md.token_query_idx]
        return result
