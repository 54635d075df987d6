"""LogitsProcessors that constrain which tokens may come next: allowed token ids, bad words,
min_tokens and logit_bias (vLLM's and OpenAI's semantics).

Each keeps per-row state for the persistent batch, as `logits_processor.LogitsProcessor` says, and
touches only the rows that ask for it (most rows ask for none, so `apply` loops over the few that do):
- `AllowedTokensProcessor`: every token outside the row's `allowed_token_ids` gets -inf.
- `BadWordsProcessor`: a bad word is a token sequence; its last token gets -inf when the output so far
  ends with the rest of it (a one-token word: always). The front end turns each word into the
  sequences of the word alone and after a space, so it is barred at the start and mid-text.
- `MinTokensProcessor`: until a row has `min_tokens` output tokens, EOS (unless ignored) and its stop
  token ids get -inf.
- `LogitBiasProcessor`: adds each listed token's bias (OpenAI's [-100, 100]) to its logit.
The runner applies them in that order, before the penalties.
"""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams


def on(device: torch.device, values: object, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without waiting for the device's queue."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class _SparseRows:
    """Per-row state kept only for rows that use a processor; rows move with the batch."""

    def __init__(self) -> None:
        self.state: dict[int, object] = {}
        self.outputs: dict[int, list[int]] = {}  # the output tokens of rows that need them

    @property
    def active(self) -> bool:
        return bool(self.state)

    def remove_row(self, row: int) -> None:
        self.state.pop(row, None)
        self.outputs.pop(row, None)

    def move_row(self, src: int, dst: int) -> None:
        for table in (self.state, self.outputs):
            if src in table:
                table[dst] = table.pop(src)

    def append_token(self, row: int, token: int) -> None:
        if row in self.outputs:
            self.outputs[row].append(token)

    def rows_in(self, row_ids: list[int]) -> list[tuple[int, int]]:
        """(logits row, batch row) for the batch rows this processor has state for."""
        return [(i, r) for i, r in enumerate(row_ids) if r in self.state]


class AllowedTokensProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.allowed_token_ids is not None:
            self.state[row] = list(params.allowed_token_ids)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for i, r in self.rows_in(row_ids):
            allowed = on(logits.device, self.state[r], torch.int64)  # type: ignore[arg-type]
            keep = logits[i].index_select(0, allowed)
            logits[i] = float("-inf")
            logits[i, allowed] = keep
        return logits


class BadWordsProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.bad_words_token_ids:
            self.state[row] = [list(w) for w in params.bad_words_token_ids]
            self.outputs[row] = []

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for i, r in self.rows_in(row_ids):
            output = self.outputs[r]
            for word in self.state[r]:  # type: ignore[attr-defined]
                prefix = word[:-1]
                if not prefix or output[len(output) - len(prefix) :] == prefix:
                    logits[i, word[-1]] = float("-inf")
        return logits


class MinTokensProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if params.min_tokens > 0 and stops:
            self.state[row] = (params.min_tokens, sorted(stops))
            self.outputs[row] = []

    def append_token(self, row: int, token: int) -> None:
        super().append_token(row, token)
        if row in self.state and len(self.outputs[row]) >= self.state[row][0]:  # type: ignore[index]
            self.remove_row(row)  # reached: nothing more to mask for this request

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for i, r in self.rows_in(row_ids):
            _, stops = self.state[r]  # type: ignore[misc]
            logits[i, on(logits.device, stops, torch.int64)] = float("-inf")
        return logits


class LogitBiasProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.logit_bias:
            tokens = sorted(params.logit_bias)
            self.state[row] = (tokens, [float(params.logit_bias[t]) for t in tokens])

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for i, r in self.rows_in(row_ids):
            tokens, biases = self.state[r]  # type: ignore[misc]
            index = on(logits.device, tokens, torch.int64)
            logits[i, index] += on(logits.device, biases, logits.dtype)
        return logits
