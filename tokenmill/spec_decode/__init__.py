"""Speculative decoding: proposers guess tokens ahead, the target model verifies them in one step."""

from __future__ import annotations

from tokenmill.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import DraftModelProposer, DraftRequest, Proposer, speculates


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer `config.method` names (a draft model's: what the runner's draft proposed)."""
    if config.method == "draft_model":
        return DraftModelProposer()
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


__all__ = [
    "DraftModelProposer",
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "make_proposer",
    "speculates",
]
