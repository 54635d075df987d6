"""Which running requests take drafts this step, and how many (speculative decoding, the scheduler's side).

After a step, the runner's proposer (`spec_decode/proposer.py`: prompt lookup or a draft model)
guesses the tokens that follow each request's newest one and hands them back in `StepOutput.drafts`;
the draft policy keeps them by request (`observe`, at the end of the scheduler's update) and, at the
start of the next `schedule`, sets each running request's `draft_token_ids` (`choose`). The scheduler
sends them with the request's last token as one chunk of 1 + k tokens; the runner keeps what the
target agrees with; the scheduler counts what was kept by position (`SpecCounts`, the policy's).

`Drafting` (a `speculative_config`): a request decoding (its last token is the one to compute) whose
sampling lets its tokens be verified a step ahead (`speculates`) takes at most k drafts, and no more
than the tokens it may still generate after the one it samples anyway (max_tokens, the model's
length). With `adaptive` (the default) the measured rule of `spec_policy.py` then keeps the drafts
that pay this step, none at all where the step would cost more than they bring (large batches), and
has the runner propose nothing for the next step (`SchedulerOutput.draft_next` False) when the drafts
expected would not pay for their making as well (a draft model then runs nothing at all; it catches
up before it guesses again). `NoDrafts`: no drafts, ever (no speculative_config, or static batching).

Pure Python, as the rest of `sched`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.config import SpeculativeConfig
from tokenmill.outputs import SchedulerOutput, StepOutput
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.spec_policy import Candidate, SpeculationPolicy


@dataclass
class SpecCounts:
    """Speculative decoding's running totals (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # chunks that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    reached_per_pos: list[int] = field(default_factory=list)  # [j]: drafts at j verified, all before j kept

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        count_positions(self.reached_per_pos, self.accepted_per_pos, drafted, accepted)


def count_positions(reached: list[int], kept: list[int], drafted: int, accepted: int) -> None:
    """One verification's outcome by draft position: drafts 0..accepted were reached (the one after the
    last kept is where the target parted, if any), 0..accepted - 1 kept."""
    if len(reached) < drafted:
        reached.extend([0] * (drafted - len(reached)))
        kept.extend([0] * (drafted - len(kept)))
    for j in range(min(accepted + 1, drafted)):
        reached[j] += 1
    for j in range(accepted):
        kept[j] += 1


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


class DraftPolicy(Protocol):
    counts: SpecCounts  # what verification kept, by draft position (the scheduler records it)

    def choose(self, running: list[Request], budget: int) -> bool:
        """Set each running request's `draft_token_ids` for this step (`budget`: the step's tokens);
        whether the runner should propose after this step (`SchedulerOutput.draft_next`)."""
        ...

    def observe(self, scheduled: SchedulerOutput, result: StepOutput) -> None:
        """The step's outcome: the runner's guesses for the next step, and what the step cost."""
        ...


class NoDrafts:
    """No speculative decoding: every request decodes a token a step, and the runner proposes nothing."""

    def __init__(self) -> None:
        self.counts = SpecCounts()

    def choose(self, running: list[Request], budget: int) -> bool:
        return False

    def observe(self, scheduled: SchedulerOutput, result: StepOutput) -> None:
        pass


class Drafting:
    """Drafts from the runner's proposer, kept where they may pay (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counts = SpecCounts()
        self.policy = SpeculationPolicy(reached=self.counts.reached_per_pos, kept=self.counts.accepted_per_pos)
        self.proposed: dict[str, list[int]] = {}  # request id -> the runner's latest guesses after its newest token
        self.worth_proposing = True  # whether the latest judgement found that drafts may pay for their making
        self._started = 0.0  # this step's start (its schedule)

    def choose(self, running: list[Request], budget: int) -> bool:
        self._started = time.perf_counter()
        for request in running:
            request.draft_token_ids = []
        self.proposed = {r.request_id: self.proposed[r.request_id] for r in running if r.request_id in self.proposed}
        rooms = {r.request_id: self._room(r) for r in running}
        takers = [r for r in running if rooms[r.request_id] > 0]
        if not takers:
            return self.worth_proposing
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        prompt = min(budget - decoding, sum(r.num_tokens - r.num_computed_tokens for r in running) - decoding)
        adaptive = self.config.adaptive
        if adaptive:  # would the drafts expected (k each, kept as measured) pay for their making too?
            offers = [Candidate(r.request_id, rooms[r.request_id], r.spec_reached, r.spec_kept) for r in takers]
            self.worth_proposing = not self.policy.curve.buckets or bool(
                self.policy.choose(decoding, prompt, offers, self.policy.proposer_seconds)
            )
            if not self.worth_proposing:
                return False
        drafts = {r.request_id: self.proposed.get(r.request_id, [])[: rooms[r.request_id]] for r in takers}
        if adaptive:
            candidates = [
                Candidate(r.request_id, len(drafts[r.request_id]), r.spec_reached, r.spec_kept) for r in takers
            ]
            keep = self.policy.choose(decoding, prompt, candidates)
            drafts = {i: d[: keep.get(i, 0)] for i, d in drafts.items()}
        for r in takers:
            r.draft_token_ids = drafts[r.request_id]
        return True

    def observe(self, scheduled: SchedulerOutput, result: StepOutput) -> None:
        """Keep the guesses for the requests of the step (none where the runner made none); measure the
        proposer's time, and on a decode-only step the step's time at its token count (the target's
        share: the proposer's time is counted apart)."""
        for chunk in scheduled.chunks:
            self.proposed[chunk.request_id] = result.drafts.get(chunk.request_id, [])
        if result.draft_seconds:
            self.policy.observe_proposer(result.draft_seconds)
        if all(len(c.token_ids) == 1 + c.num_draft_tokens for c in scheduled.chunks):
            seconds = time.perf_counter() - self._started - result.draft_seconds
            self.policy.curve.observe(scheduled.num_batched_tokens, seconds)

    def _room(self, request: Request) -> int:
        if request.num_tokens - request.num_computed_tokens != 1 or not speculates(request.sampling_params):
            return 0
        left = min(request.max_tokens - len(request.output_token_ids), self.max_model_len - request.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, left))
