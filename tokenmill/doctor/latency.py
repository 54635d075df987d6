"""Question 5, per-token latency: TPOT at the trace's load against the SLO, and what speculation would do.

TPOT comes from the simulator's replay of the trace at the current settings. Speculation with prompt
lookup is judged on the trace's own prompts, teacher-forced: at up to 64 positions of each prompt's
second half, the lookup proposes k tokens from the prompt so far, and the tokens that follow in the
prompt say how many a target would have kept (the trace's n-gram repetition; a model's own outputs
usually repeat their context more, so this is a floor). With E tokens a step yields a request on
average and a share f of requests proposing d' drafts each, a step of B requests speculating yields
B E tokens for the cost of a step running f B chunks of 1 + d' tokens and the rest of one, against B
tokens for a decode step of B: from the measured step costs, gain(B) = E x D(B) / S(B, f, d'). The
batch above which gain < 1 is where speculation would lose (the engine's adaptive rule switches it off
there by itself); it is recommended where the trace's own decode batch (the replay's median) gains at
least 10%.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.doctor.findings import Finding, p50, p90
from tokenmill.doctor.step_cost import StepCost
from tokenmill.spec_decode import DraftRequest, NgramProposer

QUESTION = "5. Per-token latency"
K = 5
CONTEXT = 512  # context the gain is judged at


@dataclass
class LookupAgreement:
    positions: int  # positions tried
    tokens_per_step: float  # E: 1 + the drafts a target would keep, on average
    drafts_per_step: float  # d: drafts proposed, on average
    proposing: float = 1.0  # share of positions where the lookup proposes anything


def lookup_agreement(prompts: Sequence[Sequence[int]], k: int = K, per_prompt: int = 64) -> LookupAgreement:
    proposer = NgramProposer(1, 4)
    kept: list[int] = []
    drafted: list[int] = []
    for prompt in prompts:
        start = len(prompt) // 2
        if len(prompt) - start < 2:
            continue
        stride = max(1, (len(prompt) - 1 - start) // per_prompt)
        for t in range(start, len(prompt) - 1, stride):
            drafts = proposer.propose([DraftRequest("doctor", prompt[:t], k)])[0]
            truth = prompt[t : t + len(drafts)]
            n = 0
            while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
                n += 1
            kept.append(n)
            drafted.append(len(drafts))
    if not kept:
        return LookupAgreement(0, 1.0, 0.0, 0.0)
    share = sum(1 for d in drafted if d) / len(drafted)
    return LookupAgreement(len(kept), 1 + statistics.fmean(kept), statistics.fmean(drafted), share)


def speculation_gain(cost: StepCost, batch: int, agreement: LookupAgreement, context: int = CONTEXT) -> float:
    """Decoding's tokens a second with prompt lookup over without, at `batch` requests: the requests that
    have drafts (the lookup's share of them) run 1 + d' tokens each (d' its drafts when it proposes), the
    others one; a step without any drafts is a plain decode step."""
    plain = cost.decode_step(batch, context)
    drafting = round(batch * agreement.proposing)
    if drafting == 0 or agreement.drafts_per_step <= 0:
        return 1.0
    per_drafting = agreement.drafts_per_step / agreement.proposing  # d': drafts where it proposes
    chunks = [(1 + round(per_drafting), context)] * drafting + [(1, context)] * (batch - drafting)
    spec = cost.predict(chunks, decoding=False)
    return agreement.tokens_per_step * plain / spec if spec > 0 else 1.0


def latency_finding(
    prompts: Sequence[Sequence[int]],
    current: dict[str, Any],
    batch: int,
    cost: StepCost,
    slos: dict[str, float],
    speculative_config: str | None,
) -> Finding:
    """`batch`: the trace's decode batch (the median of the replay's steps)."""
    agreement = lookup_agreement(prompts)
    gains = {b: speculation_gain(cost, b, agreement) for b in (1, 2, 4, 8, 16, 32, 64)}
    losing = [b for b, g in gains.items() if g < 1]
    here = speculation_gain(cost, batch, agreement)
    evidence = [
        f"TPOT at the trace's load (simulated): p50 {p50(current, 'tpot'):.1f} ms, p90 {p90(current, 'tpot'):.1f} ms"
        + (f", SLO {slos['tpot']:.0f} ms" if "tpot" in slos else ""),
        f"prompt lookup on the trace's own prompts (k = {K}, {agreement.positions} positions, teacher-forced): "
        f"{agreement.drafts_per_step:.2f} drafts a step, {agreement.tokens_per_step:.2f} tokens a verification step",
        "predicted speed-up of decoding by batch (measured step costs): "
        + ", ".join(f"{b}: {g:.2f}x" for b, g in gains.items()),
        f"the trace's decode batch (median of the replay's steps): {batch}",
    ]
    pitfalls = []
    if "tpot" in slos and p90(current, "tpot") > slos["tpot"]:
        pitfalls.append(f"TPOT p90 {p90(current, 'tpot'):.1f} ms misses the {slos['tpot']:.0f} ms SLO at this load")
    if not losing:
        breaks = "it wins at every batch measured"
    elif losing[0] == min(gains):
        breaks = "it loses at every batch"
    else:
        breaks = f"it would lose above a batch of {losing[0] // 2}"
    if speculative_config:
        return Finding(QUESTION, f"speculation is configured; at the trace's batch ({batch}) {here:.2f}x", evidence)
    if here >= 1.1:
        config = json.dumps({"method": "ngram", "num_speculative_tokens": K})
        return Finding(
            QUESTION,
            f"prompt lookup is predicted {here:.2f}x faster decoding at the trace's batch of {batch}; {breaks} (the "
            "adaptive rule switches it off there)",
            evidence,
            {"speculative_config": config},
            f"TPOT about {1 / here:.2f}x of today's at batch {batch}",
            pitfalls,
        )
    why = (
        "the prompts repeat too little for prompt lookup"
        if agreement.tokens_per_step < 1.5
        else f"at a batch of {batch} a longer step costs about what its extra tokens bring"
    )
    verdict = f"speculation is not worth it here ({here:.2f}x): {why}; {breaks}"
    return Finding(QUESTION, verdict, evidence, pitfalls=pitfalls)
