"""ModelRunner: execute(SchedulerOutput) -> StepOutput. Runs the model and samples; never holds a Request.

A step whose every row is greedy (no processors, no logprobs) may skip the logits: see `greedy_head`.
Keeps its own per-request state in a persistent batch (`InputBatch`: sampling params as per-row
tensors, seed, prompt and output ids, how far prompt logprobs got, and the logits processors' rows),
a row added when the scheduler first sends a request and removed when it reports the id finished.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from tokenmill.layers.attention import AttentionBackend, KVCache
from tokenmill.layers.sampler import LogprobsTensors, Sampler, gather_logprobs
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import SchedulerOutput, StepOutput, TokenLogprob
from tokenmill.runner.batch import ModelInputs, prepare_inputs
from tokenmill.runner.cuda_graphs import DecodeGraphs
from tokenmill.runner.input_batch import InputBatch
from tokenmill.spec_decode.draft_model import DraftRow, DraftRunner
from tokenmill.spec_decode.proposer import speculates
from tokenmill.spec_decode.rejection import RejectionSampler, Verification
from tokenmill.structured.grammar import GrammarCompiler


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        block_size: int,
        grammar: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = model.norm.weight.device
        self.sampler = Sampler(model.ops.argmax)
        self.batch = InputBatch(64, model.config.vocab_size, self.device, grammar)
        # Greedy-only steps take their tokens from `model.greedy_tokens` (no logits kept) where the
        # worker measured it faster than logits + argmax on this machine and dtype.
        self.greedy_head = False
        self.draft: DraftRunner | None = None  # speculative decoding's draft model, where one is configured
        self.rejection = RejectionSampler()  # verifies unseeded sampled requests' drafts
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs, where captured

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        for request_id in scheduled.finished_request_ids:
            self.batch.remove(request_id)
        for new in scheduled.new_requests:
            self.batch.add(new)
        if self.draft is not None:
            self.draft.begin_step(scheduled)
        result = StepOutput()
        if not scheduled.chunks:
            return result
        for c in scheduled.chunks:  # the scheduler sends only new block ids; the tables live here
            state = self.batch.state(c.request_id)
            if c.replace_block_table:
                state.block_table = list(c.new_block_ids)
            else:
                state.block_table.extend(c.new_block_ids)

        targets = {
            c.request_id: (s.next_prompt_logprob, s.prompt_token_ids)
            for c in scheduled.chunks
            if (s := self.batch.state(c.request_id)).params.prompt_logprobs is not None
            and s.next_prompt_logprob < len(s.prompt_token_ids)
        }
        tables = [self.batch.state(c.request_id).block_table for c in scheduled.chunks]
        graphs = self.graphs  # a decode-only step replays a CUDA graph (the draft model's steps: eager)
        if graphs is not None and (
            (self.draft is not None and scheduled.draft_next)
            or not graphs.covers([len(c.token_ids) for c in scheduled.chunks])
        ):
            graphs = None
        builder = graphs if graphs is not None else self.backend
        inputs = prepare_inputs(scheduled.chunks, tables, builder, self.block_size, targets, self.device)
        # on a GPU the forward is timed by two events, read after the step's one sync (its tokens)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else []
        with torch.inference_mode():
            start = time.perf_counter()
            if events:
                events[0].record()
            if self.draft is not None and scheduled.draft_next:  # the draft's KV for the step's tokens
                self.draft.mirror(inputs.input_ids, inputs.positions, inputs.metadata)
                result.draft_seconds = time.perf_counter() - start  # (the draft's share of the step)
            if graphs is not None:
                hidden = graphs.forward(inputs.input_ids, inputs.positions)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
            argmax_only = self._argmax_only(inputs)
            # [R, hidden]: the rows wanting logits (a decode-only step: every row, no copy)
            wanted = hidden if inputs.every_row else hidden.index_select(0, inputs.logits_rows)
            if self.greedy_head and argmax_only:  # greedy tokens from the hidden states
                tokens = self.model.greedy_tokens(wanted)
                if tokens is not None:
                    if events:
                        events[1].record()
                    self._accept(inputs.sample_rows, inputs.drafts, tokens.tolist(), None, result)
                    result.forward_seconds = (
                        events[0].elapsed_time(events[1]) / 1e3 if events else time.perf_counter() - start
                    )
                    self._propose(scheduled, result)
                    return result
            logits = self.model.compute_logits(wanted)  # [R, vocab] float32
            if events:  # (no sync: the sampler's kernels queue behind the forward's)
                events[1].record()
            else:
                result.forward_seconds = time.perf_counter() - start

            for rows in inputs.prompt_rows:
                state = self.batch.state(rows.request_id)
                k = state.params.prompt_logprobs or 0
                n = len(rows.targets)
                lp = torch.log_softmax(logits[rows.first_row : rows.first_row + n], dim=-1)
                targets_t = torch.tensor(rows.targets, dtype=torch.int64, device=lp.device)
                result.prompt_logprobs[rows.request_id] = to_token_logprobs(
                    gather_logprobs(lp, targets_t, k), k, rows.targets, range(n)
                )
                state.next_prompt_logprob = rows.first_position + n

            if inputs.sample_rows:
                self._sample(logits, inputs, argmax_only, result)
            self._propose(scheduled, result)
        if events:
            events[1].synchronize()  # (done already where the step read its tokens)
            result.forward_seconds = events[0].elapsed_time(events[1]) / 1e3
        return result

    def _propose(self, scheduled: SchedulerOutput, result: StepOutput) -> None:
        """The draft model's guesses after each request's newest token, for the next step."""
        if self.draft is None:
            return
        self.draft.end_step(scheduled, result.sampled, mirrored=scheduled.draft_next)
        if not scheduled.draft_next or not result.sampled:
            return
        start = time.perf_counter()
        rows, contexts = [], []
        for c in scheduled.chunks:
            sampled = result.sampled.get(c.request_id)
            state = self.batch.state(c.request_id)
            if not sampled or not speculates(state.params):
                continue
            # the newest token's position: after the chunk's computed tokens (its drafts: the kept ones)
            position = c.start_position + len(c.token_ids) - c.num_draft_tokens + len(sampled) - 1
            first_output = len(state.output_token_ids)  # the first guess's output index (its newest token is in)
            rows.append(
                DraftRow(c.request_id, sampled[-1], position, state.block_table, state.params, state.seed, first_output)
            )
            if self.draft.synced.get(c.request_id, 0) < position:  # it fell behind while the draft was idle
                context = (state.prompt_token_ids + state.output_token_ids)[:position]
                contexts.append((c.request_id, context, state.block_table))
        self.draft.catch_up(contexts, self.device)  # positions it missed while idle
        result.drafts = self.draft.propose(rows, self.device)
        result.draft_seconds += time.perf_counter() - start

    def _sample(self, logits: torch.Tensor, inputs: ModelInputs, argmax_only: bool, result: StepOutput) -> None:
        ids = list(inputs.sample_rows)
        counts = [1 + len(inputs.drafts.get(i, ())) for i in ids]  # sampling rows a request
        rows = [
            r for i, c in zip(ids, counts, strict=True) for r in range(inputs.sample_rows[i], inputs.sample_rows[i] + c)
        ]
        if rows != list(range(logits.shape[0])):  # prompt-logprob rows are mixed in: pick the sampling ones
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        firsts = dict(zip(ids, itertools.accumulate(counts, initial=0), strict=False))  # each one's first row now
        if argmax_only:  # nothing between the logits and their argmax: no sampling metadata to build
            self._accept(firsts, inputs.drafts, self.sampler.argmax(logits).tolist(), None, result)
            return
        if self.batch.grammar is not None and self.batch.grammar.active and inputs.drafts:  # rows follow drafts
            self.batch.grammar.drafts = {self.batch.row_of[i]: d for i, d in inputs.drafts.items()}
        verifications = self._verifications(firsts, inputs.drafts)
        resample = partial(self.rejection.resample, verifications=verifications) if verifications else None
        out = self.sampler(logits, self.batch.sampling_metadata(ids, counts), resample)
        self._accept(firsts, inputs.drafts, out.token_ids.tolist(), out.logprobs, result)

    def _verifications(self, firsts: dict[str, int], drafts: dict[str, list[int]]) -> list[Verification]:
        """The unseeded sampled requests with drafts: rejection sampling decides what they keep (a seeded
        or greedy one keeps the drafts equal to its own tokens)."""
        out = []
        for request_id, guess in drafts.items():
            state = self.batch.state(request_id)
            if state.params.greedy or state.params.seed is not None:
                continue
            q = self.draft.draft_probs(request_id, guess) if self.draft is not None else None
            out.append(Verification(firsts[request_id], guess, q, state.seed, len(state.output_token_ids)))
        return out

    def _accept(
        self,
        firsts: dict[str, int],
        drafts: dict[str, list[int]],
        tokens: list[int],
        logprobs: LogprobsTensors | None,
        result: StepOutput,
    ) -> None:
        """`tokens`: the target's token at each sampling row (request r's at rows firsts[r] .. firsts[r] +
        its drafts). A request keeps its drafts while each equals the target's token at its position,
        then the target's token where they part (or after the last draft). For a greedy or seeded
        request those are its own tokens: what it would have sampled one a step, since a row's token
        is a function of its logits and (seed, position). An unseeded request's rows come rewritten by
        rejection sampling (spec_decode/rejection.py): its kept drafts, then the token drawn in place of
        the first refused one."""
        lists = LogprobLists.of(logprobs) if logprobs is not None else None  # one conversion a step
        kept_ids: list[str] = []
        kept_tokens: list[int] = []
        for request_id, first in firsts.items():
            guess = drafts.get(request_id, ())
            accepted = 0
            while accepted < len(guess) and guess[accepted] == tokens[first + accepted]:
                accepted += 1
            kept = tokens[first : first + accepted + 1]
            result.sampled[request_id] = kept
            kept_ids += [request_id] * len(kept)
            kept_tokens += kept
            k = self.batch.state(request_id).params.logprobs if lists is not None else None
            if lists is not None and k is not None:
                result.logprobs[request_id] = [lists.entry(first + j, t, k) for j, t in enumerate(kept)]
        self.batch.append_tokens(kept_ids, kept_tokens)

    def _argmax_only(self, inputs: ModelInputs) -> bool:
        """This step needs nothing from the logits but each row's argmax: every sampling row greedy,
        no logits processor, no logprobs, no prompt logprobs."""
        if inputs.prompt_rows or not inputs.sample_rows:
            return False
        rows = [self.batch.state(i) for i in inputs.sample_rows]
        return all(s.params.greedy and s.params.logprobs is None for s in rows) and not any(
            p.active for p in self.batch.processors
        )


@dataclass
class LogprobLists:
    """LogprobsTensors as Python lists, converted once for the whole batch (not once per request)."""

    topk_ids: list[list[int]]  # [B][max k]
    topk_logprobs: list[list[float]]  # [B][max k]
    chosen_logprobs: list[float]  # [B]
    chosen_ranks: list[int]  # [B]

    @classmethod
    def of(cls, t: LogprobsTensors) -> LogprobLists:
        return cls(t.topk_ids.tolist(), t.topk_logprobs.tolist(), t.chosen_logprobs.tolist(), t.chosen_ranks.tolist())

    def entry(self, row: int, token: int, k: int) -> TokenLogprob:
        top = list(zip(self.topk_ids[row][:k], self.topk_logprobs[row][:k], strict=True))
        return TokenLogprob(token, self.chosen_logprobs[row], self.chosen_ranks[row], top)


def to_token_logprobs(t: LogprobsTensors, k: int, token_ids: list[int], rows: Sequence[int]) -> list[TokenLogprob]:
    """`rows` of LogprobsTensors (whose chosen tokens are `token_ids`) as TokenLogprobs with the top `k`."""
    ids, lps = t.topk_ids[:, :k].tolist(), t.topk_logprobs[:, :k].tolist()
    chosen_lp, ranks = t.chosen_logprobs.tolist(), t.chosen_ranks.tolist()
    return [
        TokenLogprob(token, chosen_lp[r], ranks[r], list(zip(ids[r], lps[r], strict=True)))
        for token, r in zip(token_ids, rows, strict=True)
    ]
