"""`tokenmill doctor --verify`: a recommendation with a real gain (continuous batching for long-tailed
outputs under static batching) measured and kept, a deliberately useless one (prefix caching on prompts
that share nothing) measured and withdrawn, the findings and recommended settings updated, and the
simulator's error reported when its cost model is not this machine's (a fixed curve here)."""

from __future__ import annotations

import random

import pytest

from tests.test_doctor import by_question, curve, random_prompts, workload
from tokenmill.config import EngineConfig
from tokenmill.doctor.diagnose import Replays, diagnose, verify_findings
from tokenmill.doctor.findings import Finding, recommended_settings
from tokenmill.doctor.verify import apply_verdicts, headline, verify, window, window_size
from tokenmill.engine.engine import LLMEngine


def test_the_window_is_the_longest_start_of_the_trace_that_fits_the_budget():
    trace = workload(random_prompts(10, 4, 8), list(range(1, 11)))
    assert [r.max_tokens for r in window(trace, 3).requests] == [1, 2, 3]
    seconds = lambda n: 2.0 * n  # noqa: E731  (a run of n requests: 2 n seconds)
    assert window_size(seconds, 100, runs=5, budget_s=200, least=8) == 20  # 5 x 2 x 20 = 200
    assert window_size(seconds, 100, runs=5, budget_s=10, least=8) == 8  # never below `least`
    assert window_size(seconds, 6, runs=5, budget_s=10, least=8) == 6  # nor above the trace


@pytest.mark.timeout(300)
def test_continuous_batching_is_kept_by_measurement(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    static = LLMEngine(EngineConfig.from_kwargs(model, dtype="float32", max_num_seqs=8, scheduling="static"))
    rng = random.Random(3)
    outputs = [160 if i % 8 == 0 else rng.randint(4, 12) for i in range(32)]  # a long one in every batch
    trace = workload(random_prompts(32, 16, 48, seed=3), outputs)
    d = diagnose(static, trace, curve(), measure_quantization=False, measure_stalls=False)
    assert by_question(d, 3).settings == {"scheduling": "continuous"}
    verified = verify_findings(static, d, trace, None, budget_s=600, repeats=3)
    v = next(v for v in verified if v.label.startswith("3."))
    assert v.kept and v.gain("output_throughput") > 1.3  # measured, not predicted
    assert by_question(d, 3).settings == {"scheduling": "continuous"}
    assert any(e.startswith("verified: 3. Length variance") for e in by_question(d, 3).evidence)
    assert recommended_settings(d.findings)["scheduling"] == "continuous"
    assert not static.has_unfinished_requests()


@pytest.mark.timeout(300)
def test_a_useless_recommendation_is_withdrawn_by_measurement(tiny_model_dir):
    """A larger batch limit for a trace that never has two requests in flight: both engines run the same
    schedule, so whatever the runs differ by is noise."""
    model = str(tiny_model_dir("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="float32", max_num_seqs=4))
    trace = workload(random_prompts(12, 48, 96, seed=8), [24] * 12, arrivals=[0.25 * i for i in range(12)])
    useless = Finding("4. Planted", "planted", settings={"max_num_seqs": 32})
    replays = Replays.of(engine, curve(), trace, None)

    def predict(settings, _):
        return headline(replays(settings))

    def build(settings):
        return LLMEngine(EngineConfig.from_kwargs(model, dtype="float32", **{"max_num_seqs": 4, **settings}))

    [v] = verify(engine, build, trace, [useless], predict, None, repeats=3)
    assert not v.kept, v.line()
    assert v.noise >= 0.05 and all(len(g) == 3 for g in v.gains.values())
    assert abs(v.predicted_gain["output_throughput"] - 1) < 0.02  # the simulator agrees: nothing to gain
    assert abs(v.gain("output_throughput") - 1) < 0.05  # (the arrivals set the pace)
    assert "withdrawn" in v.line()
    apply_verdicts([useless], [v])
    assert useless.settings == {} and "withdrawn by --verify" in useless.verdict
