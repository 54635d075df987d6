"""The `Proposer` protocol: the runner's side of speculative decoding, guessing drafts for the next step.

A proposer lives in the model runner. After each step the scheduler asked for guesses
(`SchedulerOutput.draft_next`), the runner hands it the requests that sampled and may take drafts
(`DraftRequest`: their tokens, newest last, and their block table and sampling), and it returns, per
request, up to `num_drafts` tokens it guesses to follow the newest one (`guess`); they go back to the
scheduler in `StepOutput.drafts`, whose draft policy (`sched/draft_policy.py`) sends the ones that may
pay with the request's last token as one chunk of 1 + k tokens in the next step, and the runner
verifies them (`ModelRunner._accept`, rejection sampling for unseeded sampled requests).

Two proposers: prompt lookup (`ngram.NgramProposer`: no model, the requests' own tokens) and a draft
model (`draft_model.DraftRunner`: a smaller model that runs each step's tokens too, `mirror`, so that
its KV cache stays in step with the target's). `NoProposer` when there is no speculative_config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.outputs import SchedulerOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """What a proposer sees of a request: its tokens are prompt + output, the runner's own lists (read
    only; nothing is copied for a proposer that does not read them), its newest token last."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_drafts: int  # the most drafts to guess for it
    output_token_ids: Sequence[int] = ()
    block_table: list[int] = field(default_factory=list)  # its KV blocks (a draft model writes its own there)
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # the effective seed (the user's, or the engine's draw)

    @property
    def position(self) -> int:
        """The newest token's position."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1

    @property
    def token(self) -> int:
        """The newest token."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]


class Proposer(Protocol):
    num_drafts: int  # k: the most drafts it guesses for a request
    mirrors: bool  # it runs each step's tokens through a model of its own (such a step runs eagerly)

    def begin_step(self, scheduled: SchedulerOutput) -> None:
        """A step starts (before the forward, whether it guesses after it or not)."""
        ...

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """The step's tokens, before the target's forward (a step it will guess after)."""
        ...

    def guess(
        self, scheduled: SchedulerOutput, sampled: dict[str, list[int]], requests: list[DraftRequest]
    ) -> dict[str, list[int]]:
        """After the step (`sampled`: the tokens each request kept): per request, its guesses."""
        ...

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """[len(drafts), V]: the distribution these drafts were sampled from; None: point masses."""
        ...

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for these requests (their step failed)."""
        ...


class NoProposer:
    """No speculative decoding: nothing guessed."""

    num_drafts = 0
    mirrors = False

    def begin_step(self, scheduled: SchedulerOutput) -> None:
        pass

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass

    def guess(
        self, scheduled: SchedulerOutput, sampled: dict[str, list[int]], requests: list[DraftRequest]
    ) -> dict[str, list[int]]:
        return {}

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        return None

    def forget(self, request_ids: list[str]) -> None:
        pass
