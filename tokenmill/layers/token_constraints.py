"""LogitsProcessors that constrain which tokens may come next: allowed token ids, bad words,
min_tokens and logit_bias (vLLM's and OpenAI's semantics).

Each keeps per-row state for the persistent batch, as `logits_processor.LogitsProcessor` says, for the
rows that ask for it only, and applies itself to all of them with one masked write or one indexed
write a step: what a step costs does not grow with the length of a request's lists (a request with
50,000 bad words costs its neighbours no more than one with five). The state is built once per
request, and once per distinct list: requests that send the same list share its tensors.
- `AllowedTokensProcessor`: every token outside the row's `allowed_token_ids` gets -inf (a [V] mask).
- `BadWordsProcessor`: a bad word is a token sequence; its last token gets -inf when the output so far
  ends with the rest of it. One-token words are one index tensor; longer ones are looked up by the
  output's last tokens (a dict per prefix length), so a step checks a few prefixes, not every word.
  The front end turns each word into the sequences of the word alone and after a space, so it is
  barred at the start and mid-text.
- `MinTokensProcessor`: until a row has `min_tokens` output tokens, EOS (unless ignored) and its stop
  token ids get -inf.
- `LogitBiasProcessor`: adds each listed token's bias (OpenAI's [-100, 100]) to its logit.
Token ids at or past the logits' width (a tokenizer larger than the model's head) are never written:
they cannot be sampled anyway. The runner applies the processors in that order, before the penalties.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.sampling_params import SamplingParams


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


class _Ids:
    """A list of token ids as tensors, built on first use per (device, logits width) and kept: the
    ids below the width, and their positions in the list (for values that go with them)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self._built: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[torch.device, int], torch.Tensor] = {}

    def on(self, device: torch.device, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n] int64, their positions [n] int64), ids < width, on `device`."""
        key = (device, width)
        if key not in self._built:
            ids = torch.tensor(self.ids, dtype=torch.int64)
            where = torch.nonzero(ids < width).flatten()
            self._built[key] = (ids[where].to(device), where.to(device))
        return self._built[key]

    def mask(self, device: torch.device, width: int) -> torch.Tensor:
        """[width] bool, True at the ids."""
        key = (device, width)
        if key not in self._masks:
            ids, _ = self.on(device, width)
            mask = torch.zeros(width, dtype=torch.bool, device=device)
            mask[ids] = True
            self._masks[key] = mask
        return self._masks[key]


class _Shared:
    """Id lists by their contents, so that requests sending the same list share one `_Ids`; an entry
    lives while some row uses it."""

    def __init__(self) -> None:
        self._by_key: dict[object, tuple[object, int]] = {}

    def get(self, key: object, build: Callable[[], object]) -> object:
        value, users = self._by_key.get(key, (None, 0))
        if value is None:
            value = build()
        self._by_key[key] = (value, users + 1)
        return value

    def release(self, key: object) -> None:
        value, users = self._by_key[key]
        if users <= 1:
            del self._by_key[key]
        else:
            self._by_key[key] = (value, users - 1)


def _index_write(logits: torch.Tensor, rows: list[int], columns: list[torch.Tensor], value: float) -> None:
    """logits[row, column] = value for each logits row and its column ids, in one indexed write."""
    if not rows:
        return
    row_index = torch.cat(
        [
            torch.full((c.numel(),), i, dtype=torch.int64, device=logits.device)
            for i, c in zip(rows, columns, strict=True)
        ]
    )
    logits.index_put_((row_index, torch.cat(columns)), torch.tensor(value, dtype=logits.dtype, device=logits.device))


class AllowedTokensProcessor(_SparseRows):
    def __init__(self) -> None:
        super().__init__()
        self._shared = _Shared()

    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.allowed_token_ids is not None:
            key = params.allowed_token_ids
            self.state[row] = (key, self._shared.get(key, lambda: _Ids(list(key))))

    def remove_row(self, row: int) -> None:
        if row in self.state:
            self._shared.release(self.state[row][0])  # type: ignore[index]
        super().remove_row(row)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        pairs = self.rows_in(row_ids)
        width = logits.shape[1]
        masks = torch.stack([self.state[r][1].mask(logits.device, width) for _, r in pairs])  # type: ignore[index]
        index = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~masks, float("-inf"))  # [k, V]
        return logits


@dataclass
class _BadWords:
    """One list of bad words: the one-token words as ids, the longer ones by prefix length then prefix."""

    single: _Ids
    longer: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)  # len -> prefix -> last ids

    @classmethod
    def of(cls, words: tuple[tuple[int, ...], ...]) -> _BadWords:
        longer: dict[int, dict[tuple[int, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
        for word in words:
            if len(word) > 1:
                longer[len(word) - 1][tuple(word[:-1])].append(word[-1])
        return cls(_Ids(sorted({w[0] for w in words if len(w) == 1})), {n: dict(d) for n, d in longer.items()})

    def barred(self, output: list[int], width: int) -> list[int]:
        """The last tokens of the longer words whose prefix the output ends with, below `width`."""
        out: list[int] = []
        for n, prefixes in self.longer.items():
            if len(output) >= n:
                out += [t for t in prefixes.get(tuple(output[-n:]), ()) if t < width]
        return out


class BadWordsProcessor(_SparseRows):
    def __init__(self) -> None:
        super().__init__()
        self._shared = _Shared()

    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.bad_words_token_ids:
            key = params.bad_words_token_ids
            self.state[row] = (key, self._shared.get(key, lambda: _BadWords.of(key)))
            self.outputs[row] = []

    def remove_row(self, row: int) -> None:
        if row in self.state:
            self._shared.release(self.state[row][0])  # type: ignore[index]
        super().remove_row(row)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        width = logits.shape[1]
        index: list[int] = []
        columns: list[torch.Tensor] = []
        for i, r in self.rows_in(row_ids):
            words: _BadWords = self.state[r][1]  # type: ignore[index]
            single, _ = words.single.on(logits.device, width)
            barred = words.barred(self.outputs[r], width)
            if barred:
                single = torch.cat([single, torch.tensor(barred, dtype=torch.int64, device=logits.device)])
            index.append(i)
            columns.append(single)
        logits = logits.clone()
        _index_write(logits, index, columns, float("-inf"))
        return logits


class MinTokensProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if params.min_tokens > 0 and stops:
            self.state[row] = (params.min_tokens, _Ids(sorted(stops)))
            self.outputs[row] = []

    def append_token(self, row: int, token: int) -> None:
        super().append_token(row, token)
        if row in self.state and len(self.outputs[row]) >= self.state[row][0]:  # type: ignore[index]
            self.remove_row(row)  # reached: nothing more to mask for this request

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        pairs = self.rows_in(row_ids)
        columns = [self.state[r][1].on(logits.device, logits.shape[1])[0] for _, r in pairs]  # type: ignore[index]
        logits = logits.clone()
        _index_write(logits, [i for i, _ in pairs], columns, float("-inf"))
        return logits


class LogitBiasProcessor(_SparseRows):
    def add_row(self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos: tuple[int, ...]) -> None:
        if params.logit_bias:
            tokens = sorted(params.logit_bias)
            self.state[row] = (_Ids(tokens), torch.tensor([float(params.logit_bias[t]) for t in tokens]))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        row_index, columns, values = [], [], []
        for i, r in self.rows_in(row_ids):
            ids, biases = self.state[r]  # type: ignore[misc]
            kept, where = ids.on(logits.device, logits.shape[1])
            row_index.append(torch.full((kept.numel(),), i, dtype=torch.int64, device=logits.device))
            columns.append(kept)
            values.append(biases.to(logits.device, logits.dtype)[where])
        logits = logits.clone()
        if row_index:
            logits.index_put_((torch.cat(row_index), torch.cat(columns)), torch.cat(values), accumulate=True)
        return logits
