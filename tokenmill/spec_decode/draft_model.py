"""Draft-model speculation: a smaller model with the target's vocabulary guesses the next k tokens.

Runner side (`DraftRunner`): the draft runs every step on exactly the tokens the target runs (the
same positions, the same slots: its KV cache has the target's block layout and is indexed by the same
block tables, so prompt chunks, preemption, prefix caching and freed blocks carry over as they are),
then, for each request that sampled, k decode steps from its newest token (greedy or sampled, as the
request samples). Those steps write
past the request's computed tokens: into its own blocks where it has them, else into scratch blocks
that only the draft's cache has (ids from num_blocks on, a few per batch row), since the next step
runs the kept tokens through the draft again anyway. While the measured rule has the draft idle
(guessing would not pay) it runs nothing at all; a request that went on meanwhile has its missed
positions run through the draft, as a prompt chunk, before its next guesses.
It is the runner's `Proposer` (proposer.py) where the speculative_config names a draft model: its
guesses go back to the scheduler in `StepOutput.drafts`, and the q it sampled them from (unseeded
sampled requests) stays here, by request, until they are verified (`draft_probs`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from tokenmill.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tokenmill.layers.sampler import Sampler, SamplingMetadata
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import SchedulerOutput
from tokenmill.spec_decode.proposer import DraftRequest

DRAFT_STREAM = 0xD4AF_7000_5EED_0001  # xor-ed into an unseeded request's seed: the stream of its draft samples


class DraftRunner:
    mirrors = True  # (each step the draft guesses after runs the step's tokens first)

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
        # request -> its positions [0, n) whose tokens the draft's KV holds (it falls behind while the
        # rule has the draft idle; it catches up before it guesses again)
        self.synced: dict[str, int] = {}
        self.sampler = Sampler(model.ops.argmax)
        self.device = model.norm.weight.device
        # request -> (its latest guesses, q at each [k, V]) for unseeded sampled requests
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    @staticmethod
    def scratch_blocks(max_rows: int, num_drafts: int, block_size: int) -> int:
        """Blocks beyond the target's that the draft's cache needs for `max_rows` proposing rows."""
        return max_rows * (-(-num_drafts // block_size) + 1)

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for these requests (their step failed)."""
        for request_id in request_ids:
            self.synced.pop(request_id, None)
            self._probs.pop(request_id, None)

    def begin_step(self, scheduled: SchedulerOutput) -> None:
        for request_id in scheduled.finished_request_ids:
            self.synced.pop(request_id, None)
            self._probs.pop(request_id, None)
        for c in scheduled.chunks:
            if c.replace_block_table:  # (re)started in other blocks: nothing of it is there
                self.synced[c.request_id] = 0

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Run the step's tokens through the draft: its KV for them, as the target's."""
        self.model(input_ids, positions, self.caches, metadata)

    def end_step(self, scheduled: SchedulerOutput, sampled: dict[str, list[int]], mirrored: bool) -> None:
        """After the step's verification: the positions the mirrored tokens made valid (a chunk of drafts:
        its last token and the kept drafts), for requests that were in step before it."""
        if not mirrored:
            return
        for c in scheduled.chunks:
            if self.synced.get(c.request_id, 0) < c.start_position:
                continue  # it fell behind: the catch-up before its next guess covers this chunk too
            kept = len(sampled.get(c.request_id, ())) - 1 if c.num_draft_tokens else 0
            self.synced[c.request_id] = c.start_position + len(c.token_ids) - c.num_draft_tokens + kept

    def guess(
        self, scheduled: SchedulerOutput, sampled: dict[str, list[int]], requests: list[DraftRequest]
    ) -> dict[str, list[int]]:
        """After a step it mirrored: the positions made valid, the catch-up of requests that fell
        behind while it was idle, then k guesses for each request."""
        self.end_step(scheduled, sampled, mirrored=True)
        behind = [
            (r.request_id, (list(r.prompt_token_ids) + list(r.output_token_ids))[: r.position], r.block_table)
            for r in requests
            if self.synced.get(r.request_id, 0) < r.position
        ]
        self.catch_up(behind)  # positions it missed while idle
        return self._guess(requests)

    def catch_up(self, rows: list[tuple[str, list[int], list[int]]]) -> None:
        """rows: (request id, its tokens up to its newest one, its block table): the draft's KV for the
        positions it missed, one prompt-like chunk each."""
        behind = [(i, tokens, table) for i, tokens, table in rows if self.synced.get(i, 0) < len(tokens)]
        if not behind:
            return
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for request_id, tokens, table in behind:
            start = self.synced.get(request_id, 0)
            ids += tokens[start:]
            positions += range(start, len(tokens))
            query_lens.append(len(tokens) - start)
            seq_lens.append(len(tokens))
            tables.append(table)
            self.synced[request_id] = len(tokens)
        md = self.backend.build_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        as_tensor = partial(torch.tensor, dtype=torch.int64, device=self.device)
        self.model(as_tensor(ids), as_tensor(positions), self.caches, md)

    def _guess(self, rows: list[DraftRequest]) -> dict[str, list[int]]:
        """k draft tokens for each row. Row i writes past its table into scratch blocks num_blocks +
        i * scratch_per_row ... Greedy requests get the draft's argmax; sampled ones a sample of its
        distribution q (their temperature, top-k, top-p and min-p applied): a seeded request's from
        the noise its target samples with at that output position (the two agree wherever the
        distributions are close), an unseeded one's from a stream of its own, with q kept for the
        rejection sampling that verifies it (`draft_probs`)."""
        for row in rows:
            self._probs.pop(row.request_id, None)
        if not rows:
            return {}
        device = self.device
        k, bs = self.num_drafts, self.block_size
        tables = []
        for i, row in enumerate(rows):
            need = -(-(row.position + k) // bs)  # blocks holding positions up to position + k - 1
            first = self.num_blocks + i * self.scratch_per_row
            table = row.block_table
            tables.append(table[:need] + list(range(first, first + max(0, need - len(table)))))
        tokens = [row.token for row in rows]
        out: list[list[int]] = [[] for _ in rows]
        unseeded = [i for i, row in enumerate(rows) if not row.params.greedy and row.params.seed is None]
        kept: list[list[torch.Tensor]] = [[] for _ in unseeded]  # [k][V] each
        sampling = None if all(row.params.greedy for row in rows) else self._metadata(rows)
        for j in range(k):
            positions = [row.position + j for row in rows]
            md = self.backend.build_metadata([1] * len(rows), [p + 1 for p in positions], tables, bs, device)
            ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64, device=device), self.caches, md)
            logits = self.model.compute_logits(hidden)  # [B, V] float32
            if sampling is None:
                tokens = self.model.ops.argmax(logits).tolist()
            else:  # guess j samples output position len(output) + j
                at_j = dataclasses.replace(sampling, output_positions=[len(row.output_token_ids) + j for row in rows])
                probs = self.sampler.probabilities(logits, at_j)  # [B, V] (one-hot rows: greedy)
                tokens = self.sampler.argmax(probs / self.sampler.exponential_noise(probs, at_j)).tolist()
                for slot, i in enumerate(unseeded):
                    kept[slot].append(probs[i])
            for row_out, token in zip(out, tokens, strict=True):
                row_out.append(token)
        for slot, i in enumerate(unseeded):
            self._probs[rows[i].request_id] = (out[i], torch.stack(kept[slot]))
        return {row.request_id: drafts for row, drafts in zip(rows, out, strict=True)}

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """[len(drafts), V]: q at each of these drafts, which its latest guesses sampled for this
        (unseeded) request; None where they sampled none for it."""
        entry = self._probs.get(request_id)
        if entry is None:
            return None
        tokens, probs = entry
        if tokens[: len(drafts)] != drafts:
            raise RuntimeError(f"request {request_id!r}: drafts to verify {drafts} are not the ones proposed {tokens}")
        return probs[: len(drafts)]

    def _metadata(self, rows: list[DraftRequest]) -> SamplingMetadata:
        """The sampling of each row's first guess: a seeded request on its own seed's stream, an unseeded
        one on the draft's stream of its seed."""
        seeds = [row.seed if row.params.seed is not None else row.seed ^ DRAFT_STREAM for row in rows]
        positions = [len(row.output_token_ids) for row in rows]
        params = [row.params for row in rows]
        vocab = self.model.config.vocab_size
        return SamplingMetadata.build(params, seeds, positions, vocab, [], list(range(len(rows))), self.device)
