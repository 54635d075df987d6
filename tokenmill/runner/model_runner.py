"""ModelRunner: execute(SchedulerOutput) -> StepOutput. Runs the model and samples; never holds a Request.

Keeps its own per-request batch state (sampling params, seed, prompt and output ids for penalties,
how far prompt logprobs got) keyed by request id, registered when the scheduler first sends a
request and dropped when it reports the id finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.layers.attention import AttentionBackend, KVCache
from tokenmill.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import SchedulerOutput, StepOutput, TokenLogprob
from tokenmill.runner.batch import prepare_inputs
from tokenmill.sampling_params import SamplingParams


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    next_prompt_logprob: int = 1  # the next prompt position whose logprob is owed


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[KVCache], backend: AttentionBackend, block_size: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.sampler = Sampler()
        self.states: dict[str, RequestState] = {}

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        for request_id in scheduled.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduled.new_requests:
            self.states[new.request_id] = RequestState(new.prompt_token_ids, new.sampling_params, new.seed)
        result = StepOutput()
        if not scheduled.chunks:
            return result

        targets = {
            c.request_id: (s.next_prompt_logprob, s.prompt_token_ids)
            for c in scheduled.chunks
            if (s := self.states[c.request_id]).params.prompt_logprobs is not None
            and s.next_prompt_logprob < len(s.prompt_token_ids)
        }
        inputs = prepare_inputs(scheduled.chunks, self.backend, self.block_size, targets, self.device)
        with torch.inference_mode():
            start = time.perf_counter()
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
            logits = self.model.compute_logits(hidden[inputs.logits_rows])  # [R, vocab] float32
            if logits.is_cuda:
                torch.cuda.synchronize()
            result.forward_seconds = time.perf_counter() - start

            for rows in inputs.prompt_rows:
                state = self.states[rows.request_id]
                k = state.params.prompt_logprobs or 0
                n = len(rows.targets)
                lp = torch.log_softmax(logits[rows.first_row : rows.first_row + n], dim=-1)
                targets_t = torch.tensor(rows.targets, dtype=torch.int64, device=lp.device)
                result.prompt_logprobs[rows.request_id] = to_token_logprobs(
                    gather_logprobs(lp, targets_t, k), k, rows.targets, range(n)
                )
                state.next_prompt_logprob = rows.first_position + n

            if inputs.sample_rows:
                self._sample(logits, inputs.sample_rows, result)
        return result

    def _sample(self, logits: torch.Tensor, sample_rows: dict[str, int], result: StepOutput) -> None:
        ids = list(sample_rows)
        states = [self.states[i] for i in ids]
        metadata = SamplingMetadata.from_params(
            [s.params for s in states],
            [s.seed for s in states],
            [len(s.output_token_ids) for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            logits.shape[-1],
            logits.device,
        )
        rows = [sample_rows[i] for i in ids]
        if rows != list(range(logits.shape[0])):  # prompt-logprob rows are mixed in: pick the sampling ones
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        out = self.sampler(logits, metadata)
        tokens = out.token_ids.tolist()
        for b, (request_id, state, token) in enumerate(zip(ids, states, tokens, strict=True)):
            state.output_token_ids.append(token)
            result.sampled[request_id] = [token]
            if out.logprobs is not None and state.params.logprobs is not None:
                k = state.params.logprobs
                result.logprobs[request_id] = to_token_logprobs(out.logprobs, k, [token], [b])


def to_token_logprobs(t: LogprobsTensors, k: int, token_ids: list[int], rows: Sequence[int]) -> list[TokenLogprob]:
    """`rows` of LogprobsTensors (whose chosen tokens are `token_ids`) as TokenLogprobs with the top `k`."""
    ids, lps = t.topk_ids[:, :k].tolist(), t.topk_logprobs[:, :k].tolist()
    chosen_lp, ranks = t.chosen_logprobs.tolist(), t.chosen_ranks.tolist()
    return [
        TokenLogprob(token, chosen_lp[r], ranks[r], list(zip(ids[r], lps[r], strict=True)))
        for token, r in zip(token_ids, rows, strict=True)
    ]
