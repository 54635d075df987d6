"""Greedy steps that take their tokens from the output projection in chunks (`greedy_tokens`, no
[N, vocab] logits kept) pick what logits + argmax pick, tied and untied heads; the runner uses that
path only for steps that need nothing else from the logits, and the engine's outputs match."""

from __future__ import annotations

import torch

from tests.engine.test_engine import assert_no_leaks, greedy, prompts
from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tokenmill import LLM
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models import llama
from tokenmill.models.loader import load_model


def test_greedy_tokens_equal_the_argmax_of_the_logits(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(llama, "GREEDY_CHUNK_VALUES", 3 * 1000)  # several chunks at 3 rows, a ragged last one
    for tied in (False, True):
        model = load_model(tiny_model_dir("llama", tied=tied), dtype="float32", ops=get_layer_ops("torch"))
        hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(int(tied)))
        expected = model.compute_logits(hidden).argmax(dim=-1)
        assert torch.equal(model.greedy_tokens(hidden), expected)
        # a tie across chunks goes to the first index, as argmax's does
        weight = model.embed_tokens.weight if tied else model.lm_head.weight
        row = torch.zeros(1, model.config.hidden_size)
        row[0, 0] = 1.0
        weight[:, 0] = -1.0
        weight[10, 0] = weight[3500, 0] = 5.0  # one row's chunks are 3000 tokens: these two are in different ones
        assert model.greedy_tokens(row).item() == model.compute_logits(row).argmax(dim=-1).item() == 10


def test_the_engine_with_the_greedy_head_matches_the_logits_path(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(llama, "GREEDY_CHUNK_VALUES", 4 * 1000)
    model = str(tiny_model_dir("llama"))
    ps = prompts(6, seed=5)
    head = LLM(model, max_model_len=128, kv_cache_memory=64 * 24576, greedy_head="head")
    assert not LLM(
        model, max_model_len=128, kv_cache_memory=8 * 24576, greedy_head="logits"
    ).engine.core.worker.runner.greedy_head
    calls = []
    original = head.engine.core.worker.runner.model.greedy_tokens
    head.engine.core.worker.runner.model.greedy_tokens = lambda h: calls.append(h.shape[0]) or original(h)
    fast = head.generate(ps, greedy(logprobs=None), use_tqdm=False)
    assert calls  # the head path ran
    calls.clear()
    with_logprobs = head.generate(ps, greedy(), use_tqdm=False)  # logprobs asked: the logits path
    assert not calls
    for f, w in zip(fast, with_logprobs, strict=True):
        top = top_logprobs(w.outputs[0].logprobs)
        assert_same_up_to_near_tie(f.outputs[0].token_ids, top, w.outputs[0].token_ids, top)
    assert_no_leaks(head)
