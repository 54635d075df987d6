"""LogitsProcessors: what changes a request's logits before sampling, kept per row of the persistent batch.

A `LogitsProcessor` holds per-row state for the runner's persistent batch (`runner/input_batch.py`):
a row is added when a request joins, removed when it leaves, moved when the batch is compacted, and
told each token the request samples. `apply(logits, rows)` changes the logits of the given batch
rows — one logits row per position, so several positions of one request (speculative drafts, later)
read the same batch row. Penalties live here; allowed token ids, bad words, `min_tokens` and
`logit_bias` in `token_constraints.py`; grammar bitmasks will plug in the same way.

`PenaltiesProcessor` follows Hugging Face and the OpenAI API, in this order on the raw logits:
repetition (a token seen in the prompt or the output has its logit divided by the penalty when
positive, multiplied when not), then frequency and presence (`logit -= frequency * count + presence
* (count > 0)`, counts over the output tokens only). Its [rows, vocab] state is allocated only once
a row asks for a penalty.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    def add_row(
        self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos_token_ids: tuple[int, ...]
    ) -> None:
        """A request joins the batch at `row` (its previous occupant, if any, was removed)."""
        ...

    def remove_row(self, row: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None:
        """The request at `src` now sits at `dst` (which was empty)."""
        ...

    def append_token(self, row: int, token: int) -> None:
        """The request at `row` sampled `token`."""
        ...

    @property
    def active(self) -> bool:
        """Some row needs this processor (an inactive one is skipped)."""
        ...

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        """logits [R, V] float32 of batch rows `rows` [R] int64 (on the logits' device; `row_ids`: the
        same on the host, for a processor that loops over them without reading the device) -> new
        [R, V] (the input is left as is)."""
        ...


class PenaltiesProcessor:
    def __init__(self, capacity: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.repetition = torch.ones(capacity, dtype=torch.float32, device=self.device)  # [C]
        self.presence = torch.zeros(capacity, dtype=torch.float32, device=self.device)  # [C]
        self.frequency = torch.zeros(capacity, dtype=torch.float32, device=self.device)  # [C]
        self.penalised = [False] * capacity  # rows that ask for a penalty
        self._num_penalised = 0
        self.repeating = [False] * capacity  # rows with a repetition penalty (`apply` branches on these)
        self._counts: torch.Tensor | None = None  # [C, V] float32: output token counts
        self._prompt_seen: torch.Tensor | None = None  # [C, V] bool: tokens of the prompt

    @property
    def active(self) -> bool:
        return self._num_penalised > 0

    def grow(self, capacity: int) -> None:
        """Room for `capacity` rows (state of existing rows kept)."""
        old = len(self.penalised)
        if capacity <= old:
            return
        extra = capacity - old
        self.repetition = torch.cat([self.repetition, self.repetition.new_ones(extra)])
        self.presence = torch.cat([self.presence, self.presence.new_zeros(extra)])
        self.frequency = torch.cat([self.frequency, self.frequency.new_zeros(extra)])
        self.penalised.extend([False] * extra)
        self.repeating.extend([False] * extra)
        if self._counts is not None and self._prompt_seen is not None:
            self._counts = torch.cat([self._counts, self._counts.new_zeros(extra, self.vocab_size)])
            self._prompt_seen = torch.cat([self._prompt_seen, self._prompt_seen.new_zeros(extra, self.vocab_size)])

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._prompt_seen is None:
            rows = len(self.penalised)
            self._counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
            self._prompt_seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        return self._counts, self._prompt_seen

    def add_row(
        self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        penalised = params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
        self.repetition[row] = params.repetition_penalty
        self.repeating[row] = params.repetition_penalty != 1
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.penalised[row] = penalised
        if not penalised:
            return
        self._num_penalised += 1
        counts, prompt_seen = self._state()
        counts[row] = 0
        prompt_seen[row] = False
        if prompt_token_ids:
            prompt_seen[row, torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)] = True

    def remove_row(self, row: int) -> None:
        if self.penalised[row]:
            self._num_penalised -= 1
        self.penalised[row] = self.repeating[row] = False
        self.repetition[row], self.presence[row], self.frequency[row] = 1.0, 0.0, 0.0

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.repetition, self.presence, self.frequency):
            t[dst] = t[src]
        self.penalised[dst], self.penalised[src] = self.penalised[src], False
        self.repeating[dst], self.repeating[src] = self.repeating[src], False
        if self.penalised[dst]:
            counts, prompt_seen = self._state()
            counts[dst] = counts[src]
            prompt_seen[dst] = prompt_seen[src]
        self.repetition[src], self.presence[src], self.frequency[src] = 1.0, 0.0, 0.0

    def append_token(self, row: int, token: int) -> None:
        if self.penalised[row]:
            counts, _ = self._state()
            counts[row, token] += 1

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        counts, prompt_seen = self._state()
        output_counts = counts.index_select(0, rows)  # [R, V]
        output_seen = output_counts > 0  # [R, V]
        repetition = self.repetition.index_select(0, rows)  # [R]
        if any(self.repeating):  # (rows without one divide or multiply by 1: unchanged)
            seen = output_seen | prompt_seen.index_select(0, rows)
            penalty = torch.where(seen, repetition.unsqueeze(-1), 1.0)  # [R, V]
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - self.frequency.index_select(0, rows).unsqueeze(-1) * output_counts
        return logits - self.presence.index_select(0, rows).unsqueeze(-1) * output_seen
