"""The `Proposer` protocol: draft tokens for decoding requests, and which requests may take them.

The engine asks its proposer once a step, before scheduling, for the running requests that are
decoding; each gets 0..max_drafts draft tokens, which the scheduler sends with the request's last
token as one chunk of 1 + k tokens, and the runner verifies (runner/spec_verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """What a proposer sees of a request: its tokens are prompt + output, the request's own lists
    (read only; nothing is copied for a proposer that does not read them)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_drafts: int  # the most drafts it may take this step (k, and the room left in the request)
    output_token_ids: Sequence[int] = ()


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Per request, in order: its draft tokens (at most its max_drafts; none is allowed)."""
        ...

    def take(self, drafts: dict[str, list[int]]) -> None:
        """What the runner drafted in the step just run (a draft model's guesses, by request); a
        proposer that guesses by itself ignores it."""
        ...


def speculates(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified a step ahead: its logits at each position must not
    depend on the tokens sampled before it in the same step, which penalties, min_tokens and the
    token constraints' per-request state would (those requests decode one token a step). A grammar
    does not stop it: its masks follow the drafts (structured/processor.py)."""
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.min_tokens == 0
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words
        and not params.bad_words_token_ids
    )


class DraftModelProposer:
    """The drafts the runner's draft model made last step, by request (none for a request it did not
    draft for: a new one, or one whose last step was a prompt chunk)."""

    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def take(self, drafts: dict[str, list[int]]) -> None:
        self.latest = drafts

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self.latest.get(r.request_id, [])[: r.max_drafts] for r in requests]
