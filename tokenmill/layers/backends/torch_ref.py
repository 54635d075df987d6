"""Pure-torch reference attention over a paged KV cache; runs on CPU (and anywhere torch runs).

One padded SDPA call per layer: each sequence's cached K/V are gathered through its block table
into [B, max_seq_len, kv_heads, head_dim], the new queries are scattered into
[B, max_query_len, heads, head_dim], and a mask built from absolute positions applies causality,
sequence length and the sliding window at once. GQA/MQA go through SDPA's `enable_gqa`. A single
sequence with nothing cached (the first chunk of a prompt) skips the gather and the mask.

The attention math runs in float32 whatever the cache dtype: it is the reference, and on CPU
torch's bfloat16 SDPA is several times slower than converting and running in float32.
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
        num_seqs = md.block_tables.shape[0]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        # Write only the real tokens: padding never touches the cache.
        cache.k.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k[:n])
        cache.v.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v[:n])

        if num_seqs == 1 and md.max_seq_len == n and sliding_window is None:
            # A single sequence with nothing cached yet: plain causal attention over its own tokens.
            # (4-D inputs: torch's CPU flash kernel takes them, 3-D ones fall back to the math path)
            out = F.scaled_dot_product_attention(
                q[None, :n].transpose(1, 2).float(),  # [1, heads, n, D]
                k[None, :n].transpose(1, 2).float(),  # [1, kv_heads, n, D]
                v[None, :n].transpose(1, 2).float(),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)  # [n, heads, D]
            return self._pad(out.to(q.dtype), q.shape[0])

        ctx = md.max_seq_len
        keys = cache.k[md.block_tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :ctx]
        values = cache.v[md.block_tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :ctx]

        decode_only = md.max_query_len == 1  # one new token per sequence: no scatter needed
        if decode_only:
            queries = q[:n, None]  # [B, 1, heads, D]
        else:
            queries = q.new_zeros(num_seqs, md.max_query_len, q.shape[1], head_dim)
            queries[md.token_seq, md.token_query_idx] = q[:n]

        key_pos = torch.arange(ctx, device=q.device)  # [ctx]
        q_pos = md.query_positions[:, :, None]  # [B, max_q, 1]
        mask = key_pos <= q_pos  # [B, max_q, ctx]; also excludes keys past the sequence's end
        if sliding_window is not None:
            mask &= key_pos > q_pos - sliding_window

        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2).float(),  # [B, heads, max_q, D]
            keys.transpose(1, 2).float(),  # [B, kv_heads, ctx, D]
            values.transpose(1, 2).float(),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, max_q, heads, D]
        real = out[:, 0] if decode_only else out[md.token_seq, md.token_query_idx]  # [n, heads, D]
        return self._pad(real.to(q.dtype), q.shape[0])

    @staticmethod
    def _pad(real: torch.Tensor, total: int) -> torch.Tensor:
        """[n, heads, D] -> [total, heads, D], zeros for the batch's padding rows."""
        if real.shape[0] == total:
            return real
        return torch.cat([real, real.new_zeros(total - real.shape[0], *real.shape[1:])])
