"""Speculation: before each step, the drafts of the running requests that decode.

Which requests take drafts, and how many: a request decoding (its last token is the one to compute)
whose sampling lets its tokens be verified a step ahead (`speculates`), at most k, and no more than
the tokens it may still generate after the one it samples anyway (max_tokens, the model's length).
The proposer guesses; the scheduler sends what fits; the runner keeps what the target agrees with.
"""

from __future__ import annotations

from tokenmill.request import Request
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import DraftRequest, Proposer, speculates


class Speculation:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    def draft(self, running: list[Request]) -> None:
        """Set each running request's draft_token_ids for this step (none for those that take none)."""
        asks: list[DraftRequest] = []
        takers: list[Request] = []
        for request in running:
            request.draft_token_ids = []
            room = self._room(request)
            if room > 0:
                asks.append(DraftRequest(request.request_id, request.token_ids(0, request.num_tokens), room))
                takers.append(request)
        if asks:
            for request, drafts in zip(takers, self.proposer.propose(asks), strict=True):
                request.draft_token_ids = list(drafts[: self._room(request)])

    def _room(self, request: Request) -> int:
        if request.num_tokens - request.num_computed_tokens != 1 or not speculates(request.sampling_params):
            return 0
        left = min(request.max_tokens - len(request.output_token_ids), self.max_model_len - request.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, left))
