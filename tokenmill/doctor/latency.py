"""Question 5, per-token latency: TPOT at the trace's load against the SLO, and what speculation would do.

TPOT comes from the simulator's replay of the trace at the current settings. Speculation with prompt
lookup is judged on the trace's own prompts, teacher-forced: at up to 64 positions of each prompt's
second half, the lookup proposes k tokens from the prompt so far, and the tokens that follow in the
prompt say how many a target would have kept (the trace's n-gram repetition; a model's own outputs
usually repeat their context more, so this is a floor). With E tokens a step yields a request on
average and a share f of requests proposing d' drafts each, a step of B requests speculating yields
B E tokens for the cost of a step running f B chunks of 1 + d' tokens and the rest of one, against B
tokens for a decode step of B: from the measured step costs, gain(B) = E x D(B) / S(B, f, d'). A draft
model (`--draft`) is judged the same way from its agreement with the target on the trace's prompts
(`draft_check.py`: f = 1, d' = k, E from the agreement), its k decode steps a step (measured on it)
added to S. The batch above which gain < 1 is where speculation would lose (the engine's adaptive rule
switches it off there by itself); the better of the two is recommended where the trace's own decode
batch (the replay's median) gains at least 10%. Speculation already configured is judged the same way
at the trace's batch, and switched off where predicted below LOSES (`--verify` then measures that
at the trace's load).
"""

from __future__ import annotations

import json
import statistics
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.config import SpeculativeConfig
from tokenmill.doctor.draft_check import DraftAgreement
from tokenmill.doctor.findings import Finding, p50, p90
from tokenmill.doctor.step_cost import StepCost
from tokenmill.spec_decode import NgramProposer

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
    """Prompt lookup's drafts at positions of each prompt's second half against the tokens that follow
    (the proposer's own search, on each prompt's tokens made into bytes once: `propose_at`)."""
    proposer = NgramProposer(1, 4)
    kept: list[int] = []
    drafted: list[int] = []
    for prompt in prompts:
        start = len(prompt) // 2
        if len(prompt) - start < 2:
            continue
        tokens = array("i", prompt)
        buf = tokens.tobytes()
        stride = max(1, (len(prompt) - 1 - start) // per_prompt)
        for t in range(start, len(prompt) - 1, stride):
            drafts = proposer.propose_at(tokens, buf, t, k)  # (what `propose` gives for prompt[:t])
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


@dataclass
class Speculator:
    """One way of speculating as judged on the trace: the setting that turns it on and what it yields."""

    name: str
    settings: dict[str, str]  # speculative_config, as serve takes it
    tokens_per_step: float  # E: tokens a verification step yields a request, on average
    drafts_per_step: float  # d: drafts a request is verified on, on average
    proposing: float  # share of requests with drafts
    draft: DraftAgreement | None = None  # a draft model's decode curve (None: drafts cost nothing)
    why_not: str = ""  # what keeps E low, for the verdict


def lookup_speculator(a: LookupAgreement) -> Speculator:
    return Speculator(
        "prompt lookup",
        {"speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": K})},
        a.tokens_per_step,
        a.drafts_per_step,
        a.proposing,
        why_not="the prompts repeat too little for prompt lookup" if a.tokens_per_step < 1.5 else "",
    )


def draft_speculator(agreement: DraftAgreement) -> Speculator:
    config = {"method": "draft_model", "model": agreement.model, "num_speculative_tokens": K}
    low = agreement.alpha < 0.5
    return Speculator(
        f"draft model {agreement.model}",
        {"speculative_config": json.dumps(config)},
        agreement.tokens_per_step(K),
        float(K),
        1.0,
        agreement,
        f"the draft agrees with the target on only {agreement.alpha:.0%} of the prompts' positions" if low else "",
    )


def speculation_gain(cost: StepCost, batch: int, spec: Speculator, context: int = CONTEXT) -> float:
    """Decoding's tokens a second with `spec` over without, at `batch` requests: the requests that have
    drafts (its share of them) run 1 + d' tokens each (d' its drafts when it proposes), the others one,
    after k draft decode steps where a draft model proposes; a step without any drafts is a plain one."""
    plain = cost.decode_step(batch, context)
    drafting = round(batch * spec.proposing)
    if drafting == 0 or spec.drafts_per_step <= 0:
        return 1.0
    per_drafting = spec.drafts_per_step / spec.proposing  # d': drafts where it proposes
    chunks = [(1 + round(per_drafting), context)] * drafting + [(1, context)] * (batch - drafting)
    # (a verification step runs every row a plain step runs and more: never cheaper, though the mixed-step
    # model, fitted on other steps, can price it below the decode curve, which read E = 1 as a speed-up)
    step = max(cost.predict(chunks, decoding=False), plain)
    if spec.draft is not None:
        step += K * spec.draft.draft_step(batch)
    return spec.tokens_per_step * plain / step if step > 0 else 1.0


LOSES = 0.95  # a configured speculation predicted below this at the trace's batch: switched off
WORTH = 1.1  # a speculation predicted at least this at the trace's batch: recommended


def latency_finding(
    prompts: Sequence[Sequence[int]],
    current: dict[str, Any],
    batch: int,
    cost: StepCost,
    slos: dict[str, float],
    speculative_config: str | None,
    draft: DraftAgreement | None = None,
) -> Finding:
    """`batch`: the trace's decode batch (the median of the replay's steps); `draft`: a draft model's
    agreement with the target on the trace, to weigh beside prompt lookup."""
    lookup = lookup_agreement(prompts)
    candidates = [lookup_speculator(lookup)] + ([draft_speculator(draft)] if draft is not None else [])
    batches = (1, 2, 4, 8, 16, 32, 64)
    gains = {s.name: {b: speculation_gain(cost, b, s) for b in batches} for s in candidates}
    here = {s.name: speculation_gain(cost, batch, s) for s in candidates}
    evidence = [
        f"TPOT at the trace's load (simulated): p50 {p50(current, 'tpot'):.1f} ms, p90 {p90(current, 'tpot'):.1f} ms"
        + (f", SLO {slos['tpot']:.0f} ms" if "tpot" in slos else ""),
        f"prompt lookup on the trace's own prompts (k = {K}, {lookup.positions} positions, teacher-forced): "
        f"{lookup.drafts_per_step:.2f} drafts a step, {lookup.tokens_per_step:.2f} tokens a verification step",
    ]
    if draft is not None:
        evidence.append(
            f"draft model {draft.model} on the trace's own prompts ({draft.positions} positions, teacher-forced): "
            f"its most likely token is the target's at {draft.alpha:.0%} of them, so {draft.tokens_per_step(K):.2f} "
            f"tokens a verification of k = {K}; its decode step measured here: "
            + ", ".join(f"{b}: {t * 1e3:.1f} ms" for b, t in zip(draft.decode_batch, draft.decode_seconds, strict=True))
        )
    for s in candidates:
        evidence.append(
            f"predicted speed-up of decoding with {s.name} by batch (measured step costs): "
            + ", ".join(f"{b}: {g:.2f}x" for b, g in gains[s.name].items())
        )
    evidence.append(f"the trace's decode batch (median of the replay's steps): {batch}")
    pitfalls = []
    if "tpot" in slos and p90(current, "tpot") > slos["tpot"]:
        pitfalls.append(f"TPOT p90 {p90(current, 'tpot'):.1f} ms misses the {slos['tpot']:.0f} ms SLO at this load")
    best = max(candidates, key=lambda s: here[s.name])
    gain = here[best.name]
    breaks = _where_it_loses(gains[best.name])
    if speculative_config:
        said = ", ".join(f"{s.name} {here[s.name]:.2f}x" for s in candidates)
        method = SpeculativeConfig.parse(speculative_config).method
        configured = next(
            (s for s in candidates if SpeculativeConfig.parse(s.settings["speculative_config"]).method == method), None
        )
        if configured is None or here[configured.name] >= LOSES:
            return Finding(QUESTION, f"speculation is configured; at the trace's batch ({batch}): {said}", evidence)
        loss = here[configured.name]
        return Finding(
            QUESTION,
            f"speculation is configured ({configured.name}) and predicted to slow decoding at the trace's batch "
            f"of {batch} ({loss:.2f}x): switch it off; {_where_it_loses(gains[configured.name])}",
            evidence,
            {"speculative_config": None},
            f"TPOT about {loss:.2f}x of today's at batch {batch}",
            [*pitfalls, f"{configured.name} at the trace's load: {loss:.2f}x predicted (measured step costs)"],
        )
    if gain >= WORTH:
        return Finding(
            QUESTION,
            f"{best.name} is predicted {gain:.2f}x faster decoding at the trace's batch of {batch}; {breaks} (the "
            "adaptive rule switches it off there)",
            evidence,
            dict(best.settings),
            f"TPOT about {1 / gain:.2f}x of today's at batch {batch}",
            pitfalls,
        )
    reasons = [s.why_not for s in candidates if s.why_not]
    if len(reasons) < len(candidates):
        reasons.append(f"at a batch of {batch} a longer step costs about what its extra tokens bring")
    verdict = f"speculation is not worth it here ({gain:.2f}x): {'; '.join(reasons)}; {breaks}"
    return Finding(QUESTION, verdict, evidence, pitfalls=pitfalls)


def _where_it_loses(gains: dict[int, float]) -> str:
    """Where speculation loses (below 1x) or pays (WORTH or more) among the batches measured, in words
    that hold whatever the gains' shape (a gain need not fall with the batch)."""
    batches = list(gains)
    losing = [b for b in batches if gains[b] < 1]
    if len(losing) == len(batches):
        return "it loses at every batch measured"
    if losing and losing == batches[-len(losing) :]:
        return f"it would lose above a batch of {batches[batches.index(losing[0]) - 1]}"
    if losing:
        return "it loses at batches " + ", ".join(map(str, losing))
    paying = [b for b in batches if gains[b] >= WORTH]
    if len(paying) == len(batches):
        return "it wins at every batch measured"
    if not paying:
        return f"it gains under {WORTH - 1:.0%} at every batch measured"
    return f"it gains {WORTH - 1:.0%} or more only at batches " + ", ".join(map(str, paying))
