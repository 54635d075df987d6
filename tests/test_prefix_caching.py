"""Automatic prefix caching end to end: the same outputs with caching on and off, hits counted,
eviction under pressure, salts isolated, no leaked blocks."""

from __future__ import annotations

import random

from tests.test_engine import TOP, assert_no_leaks, assert_same_up_to_near_tie, tops
from tokenmill import LLM, SamplingParams

BLOCK_BYTES = 24576  # one 16-token block of the tiny llama, float32


def shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(5, 4096) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(5, 4096) for _ in range(rng.randint(1, 12))] for i in range(count)]


def test_outputs_equal_with_caching_on_and_off_under_eviction(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    ps = shared_prefix_prompts(24, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    common = {"max_model_len": 128, "kv_cache_memory": 20 * BLOCK_BYTES, "max_num_seqs": 4}
    on, off = LLM(model, **common), LLM(model, enable_prefix_caching=False, **common)
    a = on.generate(ps, params, use_tqdm=False)
    b = off.generate(ps, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert_same_up_to_near_tie(x.outputs[0].token_ids, tops(x), y.outputs[0].token_ids, tops(y))
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
    assert sum(o.num_cached_tokens for o in a) == stats["prefix_cache_hits"]
    assert all(o.num_cached_tokens % 16 == 0 for o in a)
    assert off.stats()["prefix_cache_hits"] == 0 and all(o.num_cached_tokens == 0 for o in b)
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_cached_tokens_salts_and_short_prompts(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory=64 * BLOCK_BYTES)
    prompt = shared_prefix_prompts(1, seed=2)[0] + [7] * 40
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    engine = llm.engine
    engine.add_request("salted", prompt, params, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].num_cached_tokens == 0  # another tenant's salt never shares
    short = llm.generate([[9] * 10], params, use_tqdm=False)[0]
    short_again = llm.generate([[9] * 10], params, use_tqdm=False)[0]
    assert short.num_cached_tokens == short_again.num_cached_tokens == 0  # shorter than one block
    assert_no_leaks(llm)


def test_n_children_share_the_prompt_computed_once(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    prompt = (shared_prefix_prompts(1, seed=3)[0] + [11] * 40)[:40]
    params = SamplingParams(n=3, seed=9, temperature=0.8, max_tokens=6, ignore_eos=True)
    common = {"max_model_len": 128, "kv_cache_memory": 64 * BLOCK_BYTES}
    on, off = LLM(model, **common), LLM(model, enable_prefix_caching=False, **common)
    a = on.generate([prompt], params, use_tqdm=False)[0]
    b = off.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    stats = on.stats()
    assert stats["prefix_cache_hits"] == 2 * (39 // 16) * 16  # children 1 and 2 reuse child 0's blocks
    assert stats["prompt_tokens"] == 40 + 2 * (40 - 32)
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_reset_prefix_cache_makes_the_cache_cold_and_waits_for_idle(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory=64 * BLOCK_BYTES)
    prompt = shared_prefix_prompts(1, seed=3)[0] + [8] * 40
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("busy", prompt, params)
    engine.step()
    assert not llm.reset_prefix_cache()  # refused while a request holds blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()
    assert engine.scheduler.kv.pool.num_cached == 0
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert_no_leaks(llm)
