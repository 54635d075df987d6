"""Draft-model speculation: a smaller model with the target's vocabulary guesses the next k tokens.

Runner side (`DraftRunner`): the draft runs every step on exactly the tokens the target runs (the
same positions, the same slots: its KV cache has the target's block layout and is indexed by the same
block tables, so prompt chunks, preemption, prefix caching and freed blocks carry over as they are),
then, for each request that sampled, k greedy decode steps from its newest token. Those steps write
past the request's computed tokens: into its own blocks where it has them, else into scratch blocks
that only the draft's cache has (ids from num_blocks on, a few per batch row), since the next step
runs the kept tokens through the draft again anyway.
Core side: `DraftModelProposer` (proposer.py) hands the engine's speculation what the runner proposed.
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tokenmill.models.llama import LlamaForCausalLM


class DraftRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        caches: list[KVCache],  # num_blocks + scratch blocks a layer
        backend: AttentionBackend,
        block_size: int,
        num_blocks: int,
        num_drafts: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_drafts = num_drafts
        self.scratch_per_row = -(-num_drafts // block_size) + 1

    @staticmethod
    def scratch_blocks(max_rows: int, num_drafts: int, block_size: int) -> int:
        """Blocks beyond the target's that the draft's cache needs for `max_rows` proposing rows."""
        return max_rows * (-(-num_drafts // block_size) + 1)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Run the step's tokens through the draft: its KV for them, as the target's."""
        self.model(input_ids, positions, self.caches, metadata)

    def propose(self, rows: list[tuple[str, int, int, list[int]]], device: torch.device) -> dict[str, list[int]]:
        """rows: (request id, its newest token, that token's position, its block table); k greedy draft
        tokens each. Row i writes past its table into scratch blocks num_blocks + i * scratch_per_row ..."""
        if not rows:
            return {}
        k, bs = self.num_drafts, self.block_size
        tables = []
        for i, (_, _, position, table) in enumerate(rows):
            need = -(-(position + k) // bs)  # blocks holding positions up to position + k - 1
            first = self.num_blocks + i * self.scratch_per_row
            tables.append(table[:need] + list(range(first, first + max(0, need - len(table)))))
        tokens = [token for _, token, _, _ in rows]
        out: list[list[int]] = [[] for _ in rows]
        for j in range(k):
            positions = [p + j for _, _, p, _ in rows]
            md = self.backend.build_metadata([1] * len(rows), [p + 1 for p in positions], tables, bs, device)
            ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64, device=device), self.caches, md)
            tokens = self.model.ops.argmax(self.model.compute_logits(hidden)).tolist()
            for row, token in zip(out, tokens, strict=True):
                row.append(token)
        return {request_id: drafts for (request_id, _, _, _), drafts in zip(rows, out, strict=True)}
