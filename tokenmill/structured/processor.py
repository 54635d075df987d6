"""GrammarProcessor: the logits processor that holds structured-output requests to their grammar.

One llguidance matcher per batch row that asks for structured output (`SamplingParams.structured_outputs`),
advanced with each token the row samples (and with the tokens a request already had, when it joins
with some). A speculative step's verification rows of one request get the grammar's masks after
each prefix of its drafts (consumed, masked, rolled back), so a draft the grammar refuses is rejected.
Before sampling, each such row's bitmask of allowed next tokens is computed into a
[rows, ceil(V / 32)] int32 buffer and applied to that row's logits only (disallowed: -inf); the other
rows are untouched. The mask is as wide as the model's logits: ids the tokenizer does not have are
never allowed. A matcher that has gone into an error state (it cannot happen with its own masks, but
a token forced past them could) allows only EOS, so the request ends instead of wandering.

A spec with `after_tokens` (the end of a reasoning part) waits: its row is not masked, and its matcher
hears no token, until the row has generated that sequence; from the next token on it holds as any other
(a verification row past drafts that complete the sequence gets the grammar's mask after the drafts
that follow it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import GrammarCompiler

logger = logging.getLogger("tokenmill")


@dataclass
class _Waiting:
    """A row whose grammar starts after the token sequence `after`: its matcher, and the last tokens seen."""

    matcher: Any
    after: tuple[int, ...]
    recent: list[int] = field(default_factory=list)  # at most len(after) of the latest tokens

    def saw(self, token: int) -> bool:
        """Record `token`; True when it completes the sequence."""
        self.recent = [*self.recent, token][-len(self.after) :]
        return tuple(self.recent) == self.after

    def start_in(self, tokens: Sequence[int]) -> int | None:
        """How many of `tokens` (following those seen) it takes to complete the sequence; None if they do not."""
        seen = list(self.recent)
        for j, token in enumerate(tokens):
            seen.append(token)
            if tuple(seen[-len(self.after) :]) == self.after:
                return j + 1
        return None


class GrammarProcessor:
    def __init__(self, compiler: Callable[[], GrammarCompiler], vocab_size: int) -> None:
        """`compiler`: gives the process's GrammarCompiler (built when a first request needs it)."""
        self._compiler_factory = compiler
        self._compiler: GrammarCompiler | None = None
        self.vocab_size = vocab_size
        self.matchers: dict[int, Any] = {}  # batch row -> its matcher
        self.waiting: dict[int, _Waiting] = {}  # batch row -> its matcher, until its start sequence
        self._eos: list[int] = []
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros(0, self._words, dtype=torch.int32)  # [R, W], grown as needed
        self._shifts = torch.arange(32, dtype=torch.int32)  # [32]
        self.mask_seconds = 0.0
        self.masks = 0
        # batch row -> the draft tokens its verification rows follow this step (set by the runner): the
        # mask of the row's j-th position is the grammar's after its first j drafts
        self.drafts: dict[int, list[int]] = {}

    def use_compiler(self, compiler: GrammarCompiler) -> None:
        """Share another compiler (the front end's, in the same process) instead of building one."""
        self._compiler = compiler

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._compiler_factory()
        return self._compiler

    def stats_fields(self) -> dict[str, float]:
        """The counters as EngineStats' structured_* fields (none before a first grammar row)."""
        if not self.masks:
            return {}
        compiler = self.compiler
        return {
            "structured_compiles": compiler.compiles,
            "structured_compile_seconds": compiler.compile_seconds,
            "structured_cache_hits": compiler.cache_hits,
            "structured_masks": self.masks,
            "structured_mask_seconds": self.mask_seconds,
        }

    @property
    def active(self) -> bool:
        return bool(self.matchers or self.waiting)

    def add_row(
        self, row: int, params: SamplingParams, prompt_token_ids: list[int], eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.remove_row(row)
        spec = params.structured_outputs
        if spec is None:
            return
        matcher = self.compiler.matcher(spec)
        if spec.after_tokens:
            self.waiting[row] = _Waiting(matcher, spec.after_tokens)
        else:
            self.matchers[row] = matcher
        self._eos = list(eos_token_ids) or self._eos

    def remove_row(self, row: int) -> None:
        self.matchers.pop(row, None)
        self.waiting.pop(row, None)

    def move_row(self, src: int, dst: int) -> None:
        matcher = self.matchers.pop(src, None)
        if matcher is not None:
            self.matchers[dst] = matcher
        waiting = self.waiting.pop(src, None)
        if waiting is not None:
            self.waiting[dst] = waiting

    def append_token(self, row: int, token: int) -> None:
        waiting = self.waiting.get(row)
        if waiting is not None:  # (the start sequence itself is free: the grammar hears the token after it)
            if waiting.saw(token):
                self.matchers[row] = self.waiting.pop(row).matcher
            return
        matcher = self.matchers.get(row)
        if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token):
            logger.warning("structured output: token %d broke the grammar (%s)", token, matcher.get_error())

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        """logits [R, V] of batch rows `rows` [R] (`row_ids` on the host) -> the same with each grammar
        row's disallowed tokens at -inf."""
        start = time.perf_counter()
        drafts, self.drafts = self.drafts, {}
        picked = self._picked(row_ids, drafts)
        if not picked:
            return logits
        if self._bitmask.shape[0] < len(picked):
            self._bitmask = torch.zeros(max(len(picked), 2 * self._bitmask.shape[0]), self._words, dtype=torch.int32)
        row_bytes = self._words * 4
        for j, (_, matcher, follow) in enumerate(picked):
            target = self._bitmask[j]
            # a verification row after drafts: the grammar as they leave it (up to the first one it
            # refuses: the rows past that one cannot be reached), then back
            taken = matcher.try_consume_tokens(follow) if follow else 0
            if matcher.is_error():
                target.zero_()
                for eos in self._eos:
                    target[eos // 32] |= 1 << (eos % 32)
            else:
                matcher.unsafe_compute_mask_ptr(target.data_ptr(), row_bytes)
            if taken:
                matcher.rollback(taken)
        n, vocab = len(picked), logits.shape[1]
        bits = (self._bitmask[:n].unsqueeze(-1) >> self._shifts) & 1  # [n, W, 32]
        allowed = bits.view(n, -1)[:, :vocab].bool()  # [n, V]
        # (copied to the logits' device without waiting for its queue)
        index = torch.tensor([i for i, _, _ in picked], dtype=torch.int64).to(logits.device, non_blocking=True)
        allowed = allowed.to(logits.device, non_blocking=True)
        out = logits.clone()
        out[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        self.masks += n
        self.mask_seconds += time.perf_counter() - start
        return out

    def _picked(self, row_ids: list[int], drafts: dict[int, list[int]]) -> list[tuple[int, Any, list[int]]]:
        """(logits row, its matcher, the drafts its grammar follows first) of each logits row under a
        grammar: a batch row's j-th verification row follows its first j drafts; a waiting row's only
        those after drafts that complete its start sequence (rows before that are not masked)."""
        picked: list[tuple[int, Any, list[int]]] = []
        seen: dict[int, int] = {}
        for i, r in enumerate(row_ids):
            if r not in self.matchers and r not in self.waiting:
                continue
            seen[r] = seen.get(r, -1) + 1
            before = drafts.get(r, [])[: seen[r]]
            if r in self.matchers:
                picked.append((i, self.matchers[r], before))
                continue
            waiting = self.waiting[r]
            start = waiting.start_in(before)
            if start is not None:
                picked.append((i, waiting.matcher, before[start:]))
        return picked
