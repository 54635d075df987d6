"""Automatic prefix caching end to end: the same outputs with caching on and off, hits counted,
eviction under pressure, salts isolated, no leaked blocks."""

from __future__ import annotations

import random

from tests.engine.test_engine import TOP, assert_no_leaks, same_up_to_near_tie
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
    exact = sum(same_up_to_near_tie(x, y) for x, y in zip(a, b, strict=True))
    assert exact == len(ps), f"only {exact} of {len(ps)} outputs with caching equal those without"
    stats = on.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_evictions > 0
    assert sum(o.num_cached_tokens for o in a) == stats.prefix_cache_hits
    assert all(o.num_cached_tokens % 16 == 0 for o in a)
    assert off.stats().prefix_cache_hits == 0 and all(o.num_cached_tokens == 0 for o in b)
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
    assert stats.prefix_cache_hits == 2 * (39 // 16) * 16  # children 1 and 2 reuse child 0's blocks
    assert stats.prompt_tokens == 40 + 2 * (40 - 32)
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
    assert engine.core.scheduler.kv.pool.num_cached == 0
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert_no_leaks(llm)


def test_a_block_hits_only_after_the_same_prefix(tiny_model_dir):
    """Prompt A+B+C cached, then A+C: only A hits; C's block follows another parent, so its KV (computed
    at other positions, after other tokens) must not be reused. Outputs equal caching off."""
    model = str(tiny_model_dir("llama"))
    rng = random.Random(4)
    a, b, c = ([rng.randrange(5, 4096) for _ in range(16)] for _ in range(3))
    tail = [rng.randrange(5, 4096) for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP)
    common = {"max_model_len": 128, "kv_cache_memory": 64 * BLOCK_BYTES}
    on, off = LLM(model, **common), LLM(model, enable_prefix_caching=False, **common)
    first = on.generate([a + b + c + tail], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    skipped = on.generate([a + c + tail], params, use_tqdm=False)[0]
    assert skipped.num_cached_tokens == 16  # A only
    again = on.generate([a + b + c + tail], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48
    for out in (first, skipped, again):
        ref = off.generate([out.prompt_token_ids], params, use_tqdm=False)[0]
        assert same_up_to_near_tie(out, ref)
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_abort_with_children_still_held_frees_everything(tiny_model_dir):
    common = {"max_model_len": 128, "kv_cache_memory": 64 * BLOCK_BYTES, "max_num_batched_tokens": 16}
    llm = LLM(str(tiny_model_dir("llama")), **common)
    engine = llm.engine
    prompt = shared_prefix_prompts(1, seed=5)[0] + [12] * 30
    engine.add_request("held", prompt, SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    engine.add_request("other", prompt[:20], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # child 0 computes a first chunk; children 1 and 2 wait for the whole prompt to be cached
    assert engine.stats().running == 1 and engine.stats().waiting == 3  # "other", and the two held
    assert len(engine.core.scheduler.waiting) == 1
    assert engine.abort_request("held") and not engine.abort_request("held")
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["other"]  # the held children never started
    stats = engine.stats()
    assert stats.aborted == 3 and stats.generated_tokens == 4  # the 3 children; other's 4 tokens
    assert_no_leaks(llm)
