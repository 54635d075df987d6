"""Question 5's verdict (tokenmill/doctor/latency.py) agreeing with its own evidence: a lookup that keeps
no drafts gains nothing at any batch, even where the mixed-step model prices a verification step below a
plain decode step (as on a recorded trace, where the headline said "not worth it" beside "it wins at
every batch measured" and gains of 1.3x-1.6x at E = 1.00); and where it loses or pays, named by batch."""

from __future__ import annotations

import random

from tests.doctor.test_doctor import curve
from tokenmill.doctor.latency import (
    K,
    _where_it_loses,
    latency_finding,
    lookup_agreement,
    lookup_speculator,
    speculation_gain,
)


def lookup_misses(count: int = 8, length: int = 256, seed: int = 0) -> list[list[int]]:
    """Prompts of distinct random tokens with one token (7) recurring every 8th place: the lookup proposes
    after each 7 what followed an earlier 7, and that never comes again."""
    rng = random.Random(seed)
    tokens = rng.sample(range(10, 100_000), count * length)
    return [[7 if i % 8 == 0 else tokens[p * length + i] for i in range(length)] for p in range(count)]


def test_a_lookup_that_keeps_nothing_gains_nothing_at_any_batch_and_the_verdict_says_so():
    prompts = lookup_misses()
    agreement = lookup_agreement(prompts)
    assert agreement.drafts_per_step > 0.5 and agreement.tokens_per_step == 1.0  # proposes, never kept
    cost = curve(per_token_ms=0.02, base_ms=3.0)
    cost.per_decode_key = 2e-6  # (decode attention priced, mixed steps' not: a verification step reads cheaper)
    plain, step = cost.decode_step(16, 512), cost.predict([(1 + K, 512)] + [(1, 512)] * 15, decoding=False)
    assert step < plain  # the model's quirk the gain must not read as a speed-up
    spec = lookup_speculator(agreement)
    assert all(speculation_gain(cost, b, spec) <= 1.0 for b in (1, 2, 4, 8, 16, 32, 64))
    current = {"tpot": {"median": 20.0, "p90": 30.0}}
    f = latency_finding(prompts, current, 3, cost, {"tpot": 50.0}, None)
    assert not f.settings
    assert f.verdict.startswith("speculation is not worth it here (1.00x)")
    assert "it gains under 10% at every batch measured" in f.verdict and "wins" not in f.verdict
    by_batch = next(e for e in f.evidence if e.startswith("predicted speed-up"))
    gains = by_batch.split("by batch (measured step costs): ")[1].split(", ")
    assert all(float(g.split(": ")[1].rstrip("x")) <= 1.0 for g in gains)


def test_where_speculation_loses_or_pays_is_named_by_batch_whatever_the_gains_shape():
    assert _where_it_loses({1: 1.5, 2: 1.2, 4: 0.9, 8: 0.8}) == "it would lose above a batch of 2"
    assert _where_it_loses({1: 1.2, 2: 0.9, 4: 1.3}) == "it loses at batches 2"  # (not "above a batch of 1")
    assert _where_it_loses({1: 0.9, 2: 0.8}) == "it loses at every batch measured"
    assert _where_it_loses({1: 1.5, 2: 1.1}) == "it wins at every batch measured"
    assert _where_it_loses({1: 1.0, 2: 1.05}) == "it gains under 10% at every batch measured"
    assert _where_it_loses({1: 1.0, 16: 1.3, 32: 1.6}) == "it gains 10% or more only at batches 16, 32"
