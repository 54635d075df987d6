"""Test helpers: the logit comparison rule and a step-by-step driver over a paged KV cache."""

from __future__ import annotations

import torch

from tokenmill.layers.attention import KVCache, build_attention_metadata
from tokenmill.models.llama import LlamaForCausalLM


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within `rel` of the reference's logit scale (its max |logit|)."""
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel} x logit scale {scale:.3g}"


class PagedRunner:
    """Drives the model step by step over a paged cache, the way the engine will."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, block_order: list[int]) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = model.embed_tokens.weight.dtype
        self.caches = [KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers]
        self.free = list(block_order)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, torch.Tensor], pad_to: int = 0) -> dict[int, torch.Tensor]:
        """Run new tokens for several sequences in one flat batch; returns their logits per sequence."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop(0))
            self.lens[seq] = end
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            ids.append(tokens)
            positions.append(torch.arange(start, end))
        input_ids, pos = torch.cat(ids), torch.cat(positions)
        n = len(input_ids)
        if pad_to > n:
            input_ids = torch.cat([input_ids, torch.zeros(pad_to - n, dtype=torch.int64)])
            pos = torch.cat([pos, torch.zeros(pad_to - n, dtype=torch.int64)])
        md = build_attention_metadata(query_lens, seq_lens, tables, self.block_size)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(input_ids, pos, self.caches, md))
        out, offset = {}, 0
        for seq, q in zip(chunks, query_lens, strict=True):
            out[seq] = logits[offset : offset + q]
            offset += q
        return out
