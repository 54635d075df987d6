"""Question 5's draft model: how often it agrees with the target on the trace's own prompts, and what its
steps cost on this machine.

Both models read the same prompts (up to SAMPLE of the trace's, each cut to CUT tokens) with prompt
logprobs; at every position of each prompt's second half, the target's most likely next token and the
draft's are compared, and the share that agree is alpha: the draft's acceptance rate under greedy
decoding, teacher-forced on the prompts (a model's own outputs are usually easier to predict than a
user's text, so this is a floor). With positions independent (Leviathan et al., 2023), a verification
of k drafts yields (1 - alpha^(k+1)) / (1 - alpha) tokens on average. A speculation step runs k draft
decode steps before the target verifies, so the draft's decode curve is measured on it (`Prober.decode`,
at the batches of the target's curve).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.doctor.step_cost import Prober, interpolate, monotone
from tokenmill.outputs import OutputKind
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

SAMPLE = 16  # prompts compared
CUT = 1024  # tokens of each prompt at most


@dataclass
class DraftAgreement:
    model: str  # the draft's folder
    positions: int  # positions compared
    alpha: float  # share of them where the draft's most likely token is the target's
    decode_batch: list[int]  # the draft's decode curve: requests decoding
    decode_seconds: list[float]  # its step time there

    def tokens_per_step(self, k: int) -> float:
        """Tokens a verification of k drafts yields on average: 1 + alpha + ... + alpha^k."""
        return sum(self.alpha**i for i in range(k + 1))

    def draft_step(self, batch: int) -> float:
        """Seconds for one draft decode step of `batch` requests."""
        return interpolate(self.decode_batch, self.decode_seconds, batch)


def most_likely(engine: LLMEngine, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each prompt, `engine`'s most likely token after each of its prefixes (positions 1 .. n-1)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"doctor-agree-{i}", list(prompt), params, output_kind=OutputKind.FINAL_ONLY)
    rows: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.prompt_logprobs is not None:
                rows[out.request_id] = [lp.top[0][0] for lp in out.prompt_logprobs[1:] if lp is not None]
    return [rows[f"doctor-agree-{i}"] for i in range(len(prompts))]


def draft_agreement(
    target: LLMEngine, draft: LLMEngine, prompts: Sequence[Sequence[int]], batches: Sequence[int], repeats: int = 3
) -> DraftAgreement:
    """alpha on (a sample of) `prompts`, and the draft's decode step at `batches` requests."""
    if target.model_config.vocab_size != draft.model_config.vocab_size:
        raise ValueError(
            f"draft: its vocabulary ({draft.model_config.vocab_size} tokens) is not the target's "
            f"({target.model_config.vocab_size})"
        )
    longest = min(CUT, target.max_model_len - 1, draft.max_model_len - 1)
    step = max(1, len(prompts) // SAMPLE)
    sample = [list(p[:longest]) for p in prompts[::step][:SAMPLE] if len(p) >= 4]
    agree, positions = 0, 0
    for ours, theirs in zip(most_likely(target, sample), most_likely(draft, sample), strict=True):
        half = len(ours) // 2
        agree += sum(a == b for a, b in zip(ours[half:], theirs[half:], strict=True))
        positions += len(ours) - half
    prober = Prober(draft, seed=1)
    budget = min(draft.config.max_num_batched_tokens, draft.max_model_len - 1)
    usable = [b for b in batches if b <= draft.config.max_num_seqs]
    measured = [(b, prober.decode(b, 16, budget, repeats)) for b in usable]
    kept = [(b, t) for b, t in measured if t == t]  # (nan: no step had them all decoding)
    times = monotone([t for _, t in kept]) if kept else [0.0]
    return DraftAgreement(
        str(draft.config.model),
        positions,
        agree / positions if positions else 0.0,
        [b for b, _ in kept] or [1],
        times,
    )
