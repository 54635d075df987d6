"""ModelRunner: execute(SchedulerOutput) -> StepOutput. Runs the model and samples; never holds a Request.

A step whose every row is greedy (no processors, no logprobs) may skip the logits: see `greedy_head`.
An error that belongs to one request fails it alone, reported in `StepOutput.failed` (its row could
not be built, its own logits processors fail, its logits are NaN); the others' step goes on. Any other
error is the step's: the engine core fails the step's requests and calls `forget` on them.
Keeps its own per-request state in a persistent batch (`InputBatch`: sampling params as per-row
tensors, seed, prompt and output ids, how far prompt logprobs got, and the logits processors' rows),
a row added when the scheduler first sends a request and removed when it reports the id finished.
A pooling request's chunks run in the same forward; its last chunk samples nothing: the `Pooler`
(pooler.py) reads its rows of the hidden states and puts its vector in `StepOutput.pooled`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from tokenmill.errors import describe
from tokenmill.layers.attention import AttentionBackend, KVCache
from tokenmill.layers.sampler import LogprobsTensors, Sampler, gather_logprobs
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import ScheduledChunk, SchedulerOutput, StepOutput, TokenLogprob
from tokenmill.runner.cuda_graphs import DecodeGraphs
from tokenmill.runner.input_batch import InputBatch
from tokenmill.runner.model_inputs import ModelInputs, prepare_inputs
from tokenmill.runner.multi_step import MultiStepDecode, Native, metadata_builder, model_forward
from tokenmill.runner.pooler import Pooler
from tokenmill.sched.draft_policy import speculates
from tokenmill.spec_decode.proposer import DraftRequest, NoProposer, Proposer
from tokenmill.spec_decode.rejection import RejectionSampler, Verification
from tokenmill.structured.grammar import GrammarCompiler

logger = logging.getLogger("tokenmill")
NAN_TOKEN = -1  # a sampling row's token where its logits were NaN: its request fails


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
        # speculative decoding's guesses for the next step (prompt lookup, or a draft model), where configured
        self.proposer: Proposer = NoProposer()
        self.rejection = RejectionSampler()  # verifies unseeded sampled requests' drafts
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs, where captured
        self.pooler = Pooler(model.compute_logits)  # pooling requests' vectors (embeddings, scores)
        self.multi_step = MultiStepDecode()  # greedy decodes' forwards in a row, where granted

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        result = StepOutput(failed=self._join(scheduled))
        if result.failed:  # their chunks are not computed
            chunks = [c for c in scheduled.chunks if c.request_id not in result.failed]
            scheduled = dataclasses.replace(scheduled, chunks=chunks)
        self.proposer.begin_step(scheduled)
        if not scheduled.chunks:
            return result
        tables = self._block_tables(scheduled)
        steps = self._decode_steps(scheduled)
        if steps > 1:
            self._run_steps(scheduled.chunks, tables, steps, result)
            return result

        targets = {
            c.request_id: (s.next_prompt_logprob, s.prompt_token_ids)
            for c in scheduled.chunks
            if (s := self.batch.state(c.request_id)).params.prompt_logprobs is not None
            and s.next_prompt_logprob < len(s.prompt_token_ids)
        }
        graphs = self.graphs  # a decode-only step replays a CUDA graph (those a draft model mirrors: eager)
        if graphs is not None and (
            (self.proposer.mirrors and scheduled.draft_next)
            or not graphs.covers([len(c.token_ids) for c in scheduled.chunks])
        ):
            graphs = None
        builder = graphs if graphs is not None else self.backend
        pooling = any(c.request_id in self.pooler for c in scheduled.chunks)
        chunks = [  # a pooling request's last chunk samples nothing: the pooler reads its rows
            dataclasses.replace(c, sample=False) if c.sample and c.request_id in self.pooler else c
            for c in scheduled.chunks
        ]
        inputs = prepare_inputs(chunks, tables, builder, self.block_size, targets, self.device)
        # on a GPU the forward is timed by two events, read after the step's one sync (its tokens)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else []
        with torch.inference_mode():
            start = time.perf_counter()
            if events:
                events[0].record()
            if scheduled.draft_next:  # a draft model's KV for the step's tokens
                self.proposer.mirror(inputs.input_ids, inputs.positions, inputs.metadata)
                result.draft_seconds = time.perf_counter() - start  # (the proposer's share of the step)
            if graphs is not None:
                hidden = graphs.forward(inputs.input_ids, inputs.positions)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
            if pooling:
                self.pooler.pool(scheduled.chunks, hidden, result)
            argmax_only = self._argmax_only(inputs)
            # [R, hidden]: the rows wanting logits (a decode-only step: every row, no copy)
            wanted = hidden if inputs.every_row else hidden.index_select(0, inputs.logits_rows)
            if self.greedy_head and argmax_only and self._greedy_from_head(wanted, inputs, result):
                if events:
                    events[1].record()
                    events[1].synchronize()
                    result.forward_seconds = events[0].elapsed_time(events[1]) / 1e3
                else:
                    result.forward_seconds = time.perf_counter() - start
                self._propose(scheduled, result)
                self._time_decodes(inputs, scheduled, result)
                return result
            logits = self.model.compute_logits(wanted)  # [R, vocab] float32
            if events:  # (no sync: the sampler's kernels queue behind the forward's)
                events[1].record()
            else:
                result.forward_seconds = time.perf_counter() - start
            self._prompt_logprobs(logits, inputs, result)
            if inputs.sample_rows:
                self._sample_or_blame(logits, inputs, argmax_only, result)
            self._propose(scheduled, result)
        if events:
            events[1].synchronize()  # (done already where the step read its tokens)
            result.forward_seconds = events[0].elapsed_time(events[1]) / 1e3
        self._time_decodes(inputs, scheduled, result)
        return result

    def _block_tables(self, scheduled: SchedulerOutput) -> list[list[int]]:
        """Each chunk's block table, with the blocks the scheduler sent (only new ids: the tables live here)."""
        for c in scheduled.chunks:
            state = self.batch.state(c.request_id)
            if c.replace_block_table:
                state.block_table = list(c.new_block_ids)
            else:
                state.block_table.extend(c.new_block_ids)
        return [self.batch.state(c.request_id).block_table for c in scheduled.chunks]

    def _decode_steps(self, scheduled: SchedulerOutput) -> int:
        """Forwards in a row this step runs (1: one, as usual): several only for a batch of granted
        decodes (`ScheduledChunk.num_steps`) that want nothing but each row's argmax, run eagerly (no
        CUDA graph, no drafts to mirror, nothing pooled), as many as multi_step.py's time allows."""
        chunks = scheduled.chunks
        if self.graphs is not None or scheduled.draft_next or any(c.num_steps < 2 for c in chunks):
            return 1
        if any(c.request_id in self.pooler for c in chunks) or not self._greedy_only([c.request_id for c in chunks]):
            return 1
        return self.multi_step.steps(chunks)

    def _time_decodes(self, inputs: ModelInputs, scheduled: SchedulerOutput, result: StepOutput) -> None:
        """A step of one-token decodes the scheduler granted runs to (and that ran one forward) tells
        multi_step.py what a forward costs at its batch size; with runs off, nothing to time."""
        chunks = scheduled.chunks
        if chunks[0].num_steps > 1 and inputs.every_row and len(inputs.sample_rows) == len(chunks):
            self.multi_step.observe(len(scheduled.chunks), result.forward_seconds)

    def _run_steps(self, chunks: list[ScheduledChunk], tables: list[list[int]], steps: int, result: StepOutput) -> None:
        """`steps` forwards in a row (multi_step.py), every chunk's tokens in `result`; a NaN fails its request."""
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = self.multi_step.run(
                model_forward(self.model, self.kv_caches), self._greedy_pick, chunks, tables, steps,
                metadata_builder(self.backend, self.block_size, self.device), self.device, self._native_run(),
                self.block_size,
            )  # fmt: skip
        result.forward_seconds = time.perf_counter() - start
        result.decode_steps = steps
        self.multi_step.observe(len(chunks), result.forward_seconds / steps)
        kept_ids: list[str] = []
        kept: list[int] = []
        for chunk, picked in zip(chunks, tokens, strict=True):
            if min(picked) < 0:  # a NaN row (its later tokens followed from it)
                result.failed[chunk.request_id] = "the model's output for it was NaN"
                continue
            result.sampled[chunk.request_id] = picked
            kept_ids += [chunk.request_id] * len(picked)
            kept += picked
        for request_id, why in self.batch.append_tokens(kept_ids, kept).items():
            result.sampled.pop(request_id, None)
            result.failed[request_id] = why

    def _native_run(self) -> Native | None:
        """The model's whole-run call (`greedy_run`: one native call for the run) on a CPU, None elsewhere."""
        if self.device.type != "cpu":
            return None
        model, caches, block_size = self.model, self.kv_caches, self.block_size
        return lambda ids, starts, tables, steps: model.greedy_run(ids, starts, caches, tables, block_size, steps)

    def _greedy_pick(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B] int64, NaN rows NAN_TOKEN
        """Each row's argmax token, as a greedy step picks it (in the head where the worker chose that)."""
        if self.greedy_head:
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return torch.where(torch.isnan(hidden).any(dim=-1), NAN_TOKEN, tokens)
        logits = self.model.compute_logits(hidden)
        return marking_nan(logits, self.sampler.argmax(logits))

    def _join(self, scheduled: SchedulerOutput) -> dict[str, str]:
        """Rows out for the finished requests, in for the new ones. A request whose row cannot be built
        (its own processors refuse it) fails alone: {request id: why}."""
        for request_id in scheduled.finished_request_ids:
            self.batch.remove(request_id)
            self.pooler.remove(request_id)
        failed: dict[str, str] = {}
        for new in scheduled.new_requests:
            try:
                self.batch.add(new)
                if new.pooling is not None:
                    self.pooler.add(new.request_id, new.pooling)
            except Exception as e:
                logger.warning("request %s: its sampling state could not be set up", new.request_id, exc_info=True)
                self.batch.remove(new.request_id)
                failed[new.request_id] = describe("its sampling state could not be set up", e)
        return failed

    def forget(self, request_ids: list[str]) -> None:
        """Drop every per-request state of these requests (a failed step's): their rows, the proposer's."""
        for request_id in request_ids:
            self.batch.remove(request_id)
            self.pooler.remove(request_id)
        self.proposer.forget(request_ids)

    def _greedy_from_head(self, wanted: torch.Tensor, inputs: ModelInputs, result: StepOutput) -> bool:
        """Greedy tokens from the hidden states [R, hidden] without logits (False where the head
        cannot: the caller computes logits then). A row of NaN hidden states fails its request."""
        tokens = self.model.greedy_tokens(wanted)
        if tokens is None:
            return False
        tokens = torch.where(torch.isnan(wanted).any(dim=-1), NAN_TOKEN, tokens)  # [R]
        self._accept(inputs.sample_rows, inputs.drafts, tokens.tolist(), None, result)
        return True

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: ModelInputs, result: StepOutput) -> None:
        """The rows of prompt positions whose logprobs were asked for (logits [R, vocab])."""
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

    def _sample_or_blame(
        self, logits: torch.Tensor, inputs: ModelInputs, argmax_only: bool, result: StepOutput
    ) -> None:
        """Sample; should that fail, the requests whose own logits processors fail on their row alone
        are failed and the others sampled without them (an error no request owns fails the step)."""
        try:
            self._sample(logits, inputs, argmax_only, result)
            return
        except Exception:
            blamed = self._blame(list(inputs.sample_rows))
            if not blamed:
                raise
        result.failed.update(blamed)
        rows = {i: r for i, r in inputs.sample_rows.items() if i not in blamed}
        drafts = {i: d for i, d in inputs.drafts.items() if i not in blamed}
        if rows:
            self._sample(logits, dataclasses.replace(inputs, sample_rows=rows, drafts=drafts), argmax_only, result)

    def _blame(self, request_ids: list[str]) -> dict[str, str]:
        """The requests among these whose active logits processors fail on their row alone (a zero
        row of logits): {request id: why}."""
        probe = torch.zeros(1, self.batch.vocab_size, device=self.device)  # [1, V]
        blamed: dict[str, str] = {}
        for request_id in request_ids:
            row = self.batch.row_of[request_id]
            rows = torch.tensor([row], dtype=torch.int64, device=self.device)
            for processor in [p for p in self.batch.processors if p.active]:
                try:
                    processor.apply(probe, rows, [row])
                except Exception as e:
                    logger.warning("request %s: %s failed", request_id, type(processor).__name__, exc_info=True)
                    blamed[request_id] = describe(f"{type(processor).__name__} failed", e)
                    break
        return blamed

    def _propose(self, scheduled: SchedulerOutput, result: StepOutput) -> None:
        """The proposer's guesses after each request's newest token (those that sampled and may take
        drafts), for the next step, where the scheduler asked for them."""
        if not scheduled.draft_next:
            return
        start = time.perf_counter()
        requests = []
        for c in scheduled.chunks:
            state = self.batch.state(c.request_id)
            if result.sampled.get(c.request_id) and speculates(state.params):
                # (its newest token is in its output: position and output index follow from the lists)
                requests.append(
                    DraftRequest(
                        c.request_id,
                        state.prompt_token_ids,
                        self.proposer.num_drafts,
                        state.output_token_ids,
                        state.block_table,
                        state.params,
                        state.seed,
                    )
                )
        result.drafts = self.proposer.guess(scheduled, result.sampled, requests)
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
            tokens = marking_nan(logits, self.sampler.argmax(logits))
            self._accept(firsts, inputs.drafts, tokens.tolist(), None, result)
            return
        if self.batch.grammar is not None and self.batch.grammar.active and inputs.drafts:  # rows follow drafts
            self.batch.grammar.drafts = {self.batch.row_of[i]: d for i, d in inputs.drafts.items()}
        verifications = self._verifications(firsts, inputs.drafts)
        resample = partial(self.rejection.resample, verifications=verifications) if verifications else None
        out = self.sampler(logits, self.batch.sampling_metadata(ids, counts), resample)
        self._accept(firsts, inputs.drafts, marking_nan(logits, out.token_ids).tolist(), out.logprobs, result)

    def _verifications(self, firsts: dict[str, int], drafts: dict[str, list[int]]) -> list[Verification]:
        """The unseeded sampled requests with drafts: rejection sampling decides what they keep (a seeded
        or greedy one keeps the drafts equal to its own tokens)."""
        out = []
        for request_id, guess in drafts.items():
            state = self.batch.state(request_id)
            if state.params.greedy or state.params.seed is not None:
                continue
            q = self.proposer.draft_probs(request_id, guess)
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
        the first refused one. A NAN_TOKEN (a row of NaN logits) fails its request instead."""
        lists = LogprobLists.of(logprobs) if logprobs is not None else None  # one conversion a step
        kept_ids: list[str] = []
        kept_tokens: list[int] = []
        for request_id, first in firsts.items():
            guess = drafts.get(request_id, ())
            accepted = 0
            while accepted < len(guess) and guess[accepted] == tokens[first + accepted]:
                accepted += 1
            kept = tokens[first : first + accepted + 1]
            if kept[-1] == NAN_TOKEN:  # (never a draft: the rows after it are not reached)
                result.failed[request_id] = "the model's output for it was NaN"
                continue
            result.sampled[request_id] = kept
            kept_ids += [request_id] * len(kept)
            kept_tokens += kept
            k = self.batch.state(request_id).params.logprobs if lists is not None else None
            if lists is not None and k is not None:
                result.logprobs[request_id] = [lists.entry(first + j, t, k) for j, t in enumerate(kept)]
        for request_id, why in self.batch.append_tokens(kept_ids, kept_tokens).items():  # (its token stays unsent)
            result.sampled.pop(request_id, None)
            result.logprobs.pop(request_id, None)
            result.failed[request_id] = why

    def _argmax_only(self, inputs: ModelInputs) -> bool:
        """This step needs nothing from the logits but each row's argmax: every sampling row greedy,
        no logits processor, no logprobs, no prompt logprobs."""
        if inputs.prompt_rows or not inputs.sample_rows:
            return False
        return self._greedy_only(list(inputs.sample_rows))

    def _greedy_only(self, request_ids: list[str]) -> bool:
        """Every one of these requests greedy without logprobs, and no logits processor active."""
        rows = [self.batch.state(i) for i in request_ids]
        return all(s.params.greedy and s.params.logprobs is None for s in rows) and not any(
            p.active for p in self.batch.processors
        )


def marking_nan(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [N] with NAN_TOKEN where the row's logit of its token is NaN (logits [N, V]: a row of NaN,
    as a NaN in the hidden state makes it, gives NaN whatever token it picks). O(N): one gather."""
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N]
    return torch.where(torch.isnan(chosen), NAN_TOKEN, tokens)


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
