"""`dtype="fastest"`: the ranking comes from the autotune cache (pinned here by a stub tuner), the
KL probe against float32 vetoes a dtype that strays, and the engine runs on what was chosen."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks, greedy, prompts
from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.kernels.autotune import Choice
from tokenmill.layers.backends import get_attention_backend
from tokenmill.models.loader import load_model
from tokenmill.runner import dtype_choice
from tokenmill.runner.dtype_choice import CANDIDATES, fastest_dtype, next_token_kl


class PinnedTuner:
    """Answers every `choose` with fixed timings (ms per candidate), as a seeded cache would."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings, self.ops = timings, []

    def choose(self, op, shape, candidates, repeats=5):
        assert set(candidates) == set(self.timings)
        self.ops.append((op, shape))
        return Choice(min(self.timings, key=self.timings.get), dict(self.timings), "cache")


def builder(folder):
    def build(dtype):
        backend = get_attention_backend("torch")
        return load_model(folder, dtype=dtype, backend=backend), backend

    return build


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    logits = torch.randn(4, 50)
    assert torch.allclose(next_token_kl(logits, logits + 3.0), torch.zeros(4, dtype=torch.float64), atol=1e-12)
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    expected = 0.5 * torch.log(torch.tensor(0.5) / torch.sigmoid(torch.tensor(-1.0))) + 0.5 * torch.log(
        torch.tensor(0.5) / torch.sigmoid(torch.tensor(1.0))
    )
    assert next_token_kl(p, q).item() == pytest.approx(expected.item())


def test_the_fastest_dtype_within_the_kl_bound_is_kept(tiny_model_dir, monkeypatch):
    build = builder(tiny_model_dir("llama"))
    tuner = PinnedTuner({"float32": 3.0, "bfloat16": 1.0, "float16": 2.0})
    report = fastest_dtype(build, CANDIDATES, 8, tuner)
    assert report.dtype == torch.bfloat16 and report.cached
    assert report.mean_kl["float32"] == pytest.approx(0.0, abs=1e-9)
    assert 0 < report.mean_kl["bfloat16"] <= dtype_choice.KL_BOUND
    assert [op for op, _ in tuner.ops] == ["dtype", "dtype"]  # timed at 1 row and at max rows
    assert report.timings_ms == {"float32": 3.0, "bfloat16": 1.0, "float16": 2.0}
    # a bound nothing 16-bit meets leaves float32, whatever the timings say
    monkeypatch.setattr(dtype_choice, "KL_BOUND", 1e-12)
    assert fastest_dtype(build, CANDIDATES, 8, tuner).dtype == torch.float32


def test_the_engine_runs_on_the_dtype_it_chose(tiny_model_dir, monkeypatch):
    model = str(tiny_model_dir("llama"))
    monkeypatch.setattr(dtype_choice, "KL_BOUND", 1e-12)  # only float32 qualifies: the choice is pinned
    llm = LLM(model, dtype="fastest", max_model_len=128, kv_cache_memory=32 * 24576)
    assert llm.engine.core.worker.dtype == torch.float32
    ps = prompts(3, seed=2)
    reference = LLM(model, dtype="float32", max_model_len=128, kv_cache_memory=32 * 24576)
    params = greedy(logprobs=None, max_tokens=6)
    ids = [[o.outputs[0].token_ids for o in x.generate(ps, params)] for x in (llm, reference)]
    assert ids[0] == ids[1]  # the same dtype and the same kernels: the same tokens
    assert_no_leaks(llm)


def test_fastest_is_a_dtype_setting():
    assert EngineConfig(model="m", dtype="fastest").dtype == "fastest"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="m", dtype="quickest")
