"""Prompt lookup (n-gram) drafts: no model, only the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of prompt + output are
looked for earlier in them (the latest earlier occurrence); the first n that is found proposes the
tokens that followed that occurrence, up to the request's max_drafts. The search runs over the
tokens as int32 bytes (`bytes.rfind`, C speed), a hit kept only where it falls on a token boundary.
A `Proposer` (spec_decode/proposer.py) on the runner's side: after a step, it looks up each request's
tokens as the runner holds them, its newest token included.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.outputs import SchedulerOutput
from tokenmill.spec_decode.proposer import DraftRequest

WIDTH = 4  # bytes a token in the search buffer


class NgramProposer:
    mirrors = False  # (no model of its own)

    def __init__(self, min_n: int, max_n: int, num_drafts: int = 0) -> None:
        """`num_drafts`: k, what the runner asks for each request (`propose` takes each one's max_drafts)."""
        self.min_n = min_n
        self.max_n = max_n
        self.num_drafts = num_drafts

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Per request, in order: the tokens that followed its longest suffix's latest earlier match."""
        return [self._one(r.prompt_token_ids, r.output_token_ids, r.max_drafts) for r in requests]

    def guess(
        self, scheduled: SchedulerOutput, sampled: dict[str, list[int]], requests: list[DraftRequest]
    ) -> dict[str, list[int]]:
        return {r.request_id: drafts for r, drafts in zip(requests, self.propose(requests), strict=True)}

    def begin_step(self, scheduled: SchedulerOutput) -> None:
        pass

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        return None  # (a lookup's drafts are point masses)

    def forget(self, request_ids: list[str]) -> None:
        pass

    def _one(self, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        tokens = array("i", prompt)
        tokens.extend(output)
        return self.propose_at(tokens, tokens.tobytes(), len(tokens), k)

    def propose_at(self, tokens: array[int], buf: bytes, length: int, k: int) -> list[int]:
        """The drafts for the first `length` of `tokens` (`buf`: all of them as bytes, `tokens.tobytes()`),
        as `propose` gives them for those tokens alone: one buffer serves every position of a sequence
        (the doctor's teacher-forced lookups along a prompt)."""
        if k <= 0 or length < self.min_n + 1:
            return []
        end = length * WIDTH  # (the search never reads past the first `length` tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _latest(buf, buf[end - n * WIDTH : end], end - WIDTH)  # an occurrence ending before the last token
            if start is not None:
                follow = start + n  # the token after the occurrence
                return tokens[follow : min(follow + k, length)].tolist()
        return []


def _latest(buf: bytes, needle: bytes, end: int) -> int | None:
    """The token index of the latest occurrence of `needle` in buf[:end] that starts on a token."""
    while True:
        at = buf.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % WIDTH == 0:
            return at // WIDTH
        end = at + len(needle) - 1  # a match across token boundaries: look further left
