"""Sampling: turns a batch of float32 logits into next tokens, and their log-probabilities.

Owns `SamplingMetadata` (per-row sampling parameters as tensors, and the logits processors with
the batch rows they read), `Sampler` (logits processors -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> an exact sample), `LogprobsTensors`/`gather_logprobs` (top-k and chosen-token log-probabilities,
also used for prompt logprobs). Randomness is a pure function of (seed, output position) through
`generator_seed`, which lives beside `SamplingParams` in sampling_params.py.

Semantics follow vLLM, Hugging Face and the OpenAI API:
- Log-probabilities come from the raw logits (log-softmax before penalties, temperature and
  truncation), as vLLM returns them by default.
- Logits processors (layers/logits_processor.py: penalties today) then change the raw logits, each
  reading its own state for the batch row of each logits row.
- Greedy rows (temperature 0) take the argmax of the processed logits (the first index on ties).
- Other rows: divide by the temperature, keep the top-k logits (every token tied with the k-th
  largest is kept too, as HF's `TopKLogitsWarper` does), then the smallest prefix of the sorted
  distribution whose probability reaches top_p (at least the top token; HF's `TopPLogitsWarper`),
  then drop tokens whose probability is below min_p x the top token's (HF's `MinPLogitsWarper`;
  the ratio does not depend on the earlier renormalisations), then sample.
- Sampling is an exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. per token is an exact
  sample from probs. Each row draws q from its own generator seeded by `generator_seed(seed,
  output_position)`, so a row's token depends neither on the other rows nor on their order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.layers.logits_processor import LogitsProcessor, PenaltiesProcessor
from tokenmill.sampling_params import SamplingParams, generator_seed


@dataclass
class SamplingMetadata:
    """One row per logits row sampled this step; all tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32 (0 = greedy row)
    top_k: torch.Tensor  # [B] int64 (vocab_size where the request has top_k None)
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: list[int]  # per row: the request's seed
    output_positions: list[int]  # per row: index of the output token being sampled (0 = first)
    max_num_logprobs: int  # max over rows of SamplingParams.logprobs (0 if none asks)
    logprobs_requested: bool  # some row has logprobs not None (it may ask for 0: chosen token only)
    processors: list[LogitsProcessor]  # the active ones, applied in order
    batch_rows: torch.Tensor  # [B] int64: each row's row in the processors' (persistent) batch
    # The same parameters on the host: the sampler branches on these, never on a tensor's value, so
    # that on a GPU it queues its kernels without waiting for the device (one sync a step: the tokens).
    batch_row_ids: list[int]  # [B]: batch_rows
    greedy_rows: list[bool]  # [B]
    top_k_rows: list[int]  # [B] as in top_k
    uses_top_p: bool  # some row has top_p < 1
    uses_min_p: bool  # some row has min_p > 0

    @property
    def all_greedy(self) -> bool:
        """Every row greedy: argmax of the (processed) logits, no sorting, no randomness."""
        return all(self.greedy_rows)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_positions: list[int],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """A one-off batch (rows 0..B-1 of fresh processors holding these histories); the runner
        builds its metadata from the persistent batch instead. top_k None (or above the vocabulary)
        -> vocab_size."""
        rows = len(params)
        if not (rows == len(seeds) == len(output_positions) == len(prompt_token_ids) == len(output_token_ids)):
            raise ValueError(
                "params, seeds, output_positions, prompt_token_ids and output_token_ids must have one entry per row"
            )
        penalties = PenaltiesProcessor(rows, vocab_size, device)
        for row, (p, prompt, output) in enumerate(zip(params, prompt_token_ids, output_token_ids, strict=True)):
            penalties.add_row(row, p, prompt, ())
            for token in output:
                penalties.append_token(row, token)
        return cls.build(params, seeds, output_positions, vocab_size, [penalties], list(range(rows)), device)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_positions: list[int],
        vocab_size: int,
        processors: list[LogitsProcessor],
        batch_rows: list[int],
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=floats([p.temperature for p in params]),
            top_k=torch.tensor(
                [vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in params],
                dtype=torch.int64,
                device=device,
            ),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            seeds=list(seeds),
            output_positions=list(output_positions),
            max_num_logprobs=max(requested, default=0),
            logprobs_requested=bool(requested),
            processors=[p for p in processors if p.active],
            batch_rows=torch.tensor(batch_rows, dtype=torch.int64, device=device),
            batch_row_ids=list(batch_rows),
            **host_fields(params, vocab_size),
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> [B, V] after every active logits processor (the input is left as is)."""
        for processor in self.processors:
            logits = processor.apply(logits, self.batch_rows, self.batch_row_ids)
        return logits


@dataclass
class LogprobsTensors:
    topk_ids: torch.Tensor  # [B, k] int64: the k most likely token ids, most likely first
    topk_logprobs: torch.Tensor  # [B, k] float32
    chosen_logprobs: torch.Tensor  # [B] float32: log-probability of the given (sampled) token
    chosen_ranks: torch.Tensor  # [B] int64: 1 + the number of tokens strictly more likely


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asks for logprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """logprobs [N, V] (log-softmax), token_ids [N] -> top-k ids/logprobs, the given tokens' logprobs and ranks.

    Used for sampled-token logprobs and for prompt_logprobs (where token_ids are the next prompt
    tokens). The rank is 1 + the number of tokens with a strictly larger logprob, so a token tied
    with the most likely one has rank 1.
    """
    topk_logprobs, topk_ids = torch.topk(logprobs, k, dim=-1)  # [N, k]
    chosen = logprobs.gather(-1, token_ids.long().unsqueeze(-1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    return LogprobsTensors(
        topk_ids=topk_ids, topk_logprobs=topk_logprobs, chosen_logprobs=chosen.squeeze(-1), chosen_ranks=ranks
    )


def host_fields(params: list[SamplingParams], vocab_size: int) -> dict[str, Any]:
    """SamplingMetadata's host-side fields for rows of these params."""
    return {
        "greedy_rows": [p.greedy for p in params],
        "top_k_rows": [vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in params],
        "uses_top_p": any(p.top_p < 1 for p in params),
        "uses_min_p": any(p.min_p > 0 for p in params),
    }


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """logits [B, V] -> [B, V] with tokens outside each row's top-k, then top-p, set to -inf.

    top_k [B] int64 in [1, V] (V keeps all; `max_k`: the largest k below V, from the host), top_p [B]
    float32 in (0, 1] (1 keeps all); None skips.
    """
    vocab_size = logits.shape[-1]
    if top_p is None:
        if top_k is None:
            return logits
        # Top-k alone: the k-th largest logit of each row from one topk over the largest k, no full sort.
        no_limit = top_k >= vocab_size  # [B]
        k = top_k.masked_fill(no_limit, 1)  # [B]
        largest = torch.topk(logits, max_k, dim=-1).values  # [B, max_k], descending
        kth = largest.gather(-1, (k - 1).unsqueeze(-1))  # [B, 1]
        kth = kth.masked_fill(no_limit.unsqueeze(-1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = torch.sort(logits, dim=-1)  # [B, V] ascending
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab_size - top_k).unsqueeze(-1))  # [B, 1]: the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Ascending cumulative probability: a token goes when it and every less likely token together hold
    # at most 1 - top_p, i.e. when the more likely tokens before it already reach top_p.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cumulative <= 1 - top_p.unsqueeze(-1)  # [B, V]
    drop[:, -1] = False  # the top token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Stateless: every call reads only its logits and metadata. `argmax` ([N, V] float32 -> [N] int64,
    torch's semantics) picks the greedy and the noise-divided winners (default: torch.argmax)."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        resample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """logits [B, V] float32 -> the next token of every row, with log-probabilities when asked for.
        `resample` (probs [B, V], tokens [B]) -> tokens [B] may change sampled rows' tokens before their
        log-probabilities are taken (speculative decoding's rejection sampling); greedy steps skip it."""
        logits = logits.float()
        penalised = metadata.process(logits)  # [B, V]
        if metadata.all_greedy:
            token_ids = self.argmax(penalised)  # [B]
        else:
            probs = self._probabilities(penalised, metadata)  # [B, V]
            token_ids = self.argmax(probs / self.exponential_noise(probs, metadata))  # [B]
            if resample is not None:
                token_ids = resample(probs, token_ids)
        logprobs = None
        if metadata.logprobs_requested:
            raw = torch.log_softmax(logits, dim=-1)  # [B, V]
            logprobs = gather_logprobs(raw, token_ids, metadata.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def probabilities(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [B, V] -> [B, V] float32: the distribution each row samples from (one-hot for greedy rows)."""
        logits = logits.float()
        penalised = metadata.process(logits)
        return self._probabilities(penalised, metadata)

    def _probabilities(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Penalised logits [B, V] -> [B, V] probabilities after temperature, top-k, top-p and min-p."""
        vocab_size = logits.shape[-1]
        greedy = metadata.temperature == 0  # [B]
        temperature = torch.where(greedy, 1.0, metadata.temperature).unsqueeze(-1)  # [B, 1]
        # Shifting by the row maximum first leaves the distribution unchanged and keeps tiny
        # temperatures from overflowing: the top logit becomes 0, the others <= 0 (or -inf).
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # [B, V]
        limits = [k for k in metadata.top_k_rows if k < vocab_size]
        scaled = _top_k_top_p(
            scaled,
            metadata.top_k.clamp(1, vocab_size) if limits else None,
            max(limits, default=1),
            metadata.top_p if metadata.uses_top_p else None,
        )
        probs = scaled.softmax(dim=-1)  # [B, V]
        if metadata.uses_min_p:
            top = probs.amax(dim=-1, keepdim=True)  # [B, 1]
            min_p = metadata.min_p.unsqueeze(-1)  # [B, 1]
            kept = probs.masked_fill(probs < min_p * top, 0.0)
            # Renormalise only the rows that use min-p, so a row's distribution, down to the last bit,
            # does not depend on whether another row in the batch uses it.
            probs = torch.where(min_p > 0, kept / kept.sum(dim=-1, keepdim=True), probs)
        if any(metadata.greedy_rows):
            one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
        return probs

    @staticmethod
    def exponential_noise(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[B, V] i.i.d. Exp(1) noise per sampled row, from its own (seed, position) generator; 1 for greedy rows."""
        noise = torch.ones_like(probs)
        tiny = torch.finfo(noise.dtype).tiny
        for row, (seed, position, is_greedy) in enumerate(
            zip(metadata.seeds, metadata.output_positions, metadata.greedy_rows, strict=True)
        ):
            if is_greedy:
                continue
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(generator_seed(seed, position))
            noise[row].exponential_(generator=generator)
        # A draw of exactly 0 would turn a zero probability into 0/0 = nan, which argmax prefers.
        return noise.clamp_(min=tiny)
