"""Speculative decoding, the runner's side: proposers guess tokens ahead (prompt lookup, a draft model),
the target model verifies them in one step (rejection sampling for unseeded sampled requests). Which
requests take drafts is the scheduler's (`sched/draft_policy.py`, `sched/spec_policy.py`)."""

from __future__ import annotations

from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import DraftRequest, NoProposer, Proposer

__all__ = ["DraftRequest", "NgramProposer", "NoProposer", "Proposer"]
