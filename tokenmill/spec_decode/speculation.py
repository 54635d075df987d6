"""Speculation: before each step, the drafts of the running requests that decode.

Which requests take drafts, and how many: a request decoding (its last token is the one to compute)
whose sampling lets its tokens be verified a step ahead (`speculates`), at most k, and no more than
the tokens it may still generate after the one it samples anyway (max_tokens, the model's length).
With `adaptive` (the default) the measured rule of policy.py then keeps the drafts that pay this step,
none at all where the step would cost more than they bring (large batches), and skips proposing when
the drafts expected would not pay for their making as well (a draft model then skips its passes too;
it still runs each step's tokens, to keep its KV in step with the target's). The proposer guesses;
the scheduler sends what fits; the runner keeps what the target agrees with.
"""

from __future__ import annotations

import time

from tokenmill.config import SpeculativeConfig
from tokenmill.request import Request
from tokenmill.spec_decode.policy import Candidate, SpeculationPolicy
from tokenmill.spec_decode.proposer import DraftRequest, Proposer, speculates


class Speculation:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, reached: list[int], kept: list[int]
    ) -> None:
        """`reached`, `kept`: the engine's verified and kept drafts by position (the scheduler's counts,
        read as they grow)."""
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy(reached=reached, kept=kept)
        self.worth_proposing = True  # whether the latest step judged drafts able to pay for their making
        self._proposed_seconds = 0.0  # this step's proposer call

    def draft(self, running: list[Request], budget: int) -> None:
        """Set each running request's draft_token_ids for this step (none for those that take none);
        `budget`: the step's token budget (prompt chunks take what decoding leaves)."""
        for request in running:
            request.draft_token_ids = []
        rooms = {r.request_id: self._room(r) for r in running}
        takers = [r for r in running if rooms[r.request_id] > 0]
        self._proposed_seconds = 0.0
        if not takers:
            return
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        prompt = min(budget - decoding, sum(r.num_tokens - r.num_computed_tokens for r in running) - decoding)
        adaptive = self.config.adaptive
        if adaptive:  # would the drafts expected (k each, kept as measured) pay for their making too?
            offers = [Candidate(r.request_id, rooms[r.request_id], r.spec_reached, r.spec_kept) for r in takers]
            self.worth_proposing = not self.policy.curve.buckets or bool(
                self.policy.choose(decoding, prompt, offers, self.policy.proposer_seconds)
            )
            if not self.worth_proposing:
                return
        start = time.perf_counter()
        proposals = self.proposer.propose(
            [DraftRequest(r.request_id, r.prompt_token_ids, rooms[r.request_id], r.output_token_ids) for r in takers]
        )
        self._proposed_seconds = time.perf_counter() - start
        drafts = {r.request_id: list(d[: rooms[r.request_id]]) for r, d in zip(takers, proposals, strict=True)}
        if adaptive:
            candidates = [
                Candidate(r.request_id, len(drafts[r.request_id]), r.spec_reached, r.spec_kept) for r in takers
            ]
            keep = self.policy.choose(decoding, prompt, candidates)
            drafts = {i: d[: keep.get(i, 0)] for i, d in drafts.items()}
        for r in takers:
            r.draft_token_ids = drafts[r.request_id]

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step ran `tokens` tokens in `seconds` (proposing not included)."""
        self.policy.curve.observe(tokens, seconds)

    def after_step(self, drafts: dict[str, list[int]], draft_seconds: float) -> None:
        """What the runner drafted in the step (a draft model's guesses) and what that took: with this
        step's proposer call, the cost of proposing."""
        self.proposer.take(drafts)
        spent = self._proposed_seconds + draft_seconds
        if spent:
            self.policy.observe_proposer(spent)

    def _room(self, request: Request) -> int:
        if request.num_tokens - request.num_computed_tokens != 1 or not speculates(request.sampling_params):
            return 0
        left = min(request.max_tokens - len(request.output_token_ids), self.max_model_len - request.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, left))
