"""The int8 KV cache (`kv_cache_dtype="int8"`): each token's K and V of a head in int8 with one float32
scale. Both backends quantize alike and attend over the dequantized values; the engine's greedy
outputs stay those of the float cache (up to a near tie); the same memory holds the tokens the byte
arithmetic says; preemption, prefix caching and chunked prompts work on it and leak nothing."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks, greedy, prompts
from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tokenmill import LLM
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.backends.torch_ref import attend_chunk
from tokenmill.quant.quantize import int8_rows_symmetric

BACKENDS = ["torch"] + (["cpu"] if load_cpu_kernels() is not None else [])
BLOCK = 16
# int8 K/V move the tiny test model's log-probabilities by up to 0.065 nats (measured on these prompts,
# both backends: its 0.1 init scale makes attention sharp); a divergence from the float cache's greedy
# tokens is allowed only where both tokens are within this of each other in both runs.
INT8_KV_TIE_NATS = 0.15


def assert_near(int8_out, float_out) -> None:
    """Same greedy tokens up to a first divergence within INT8_KV_TIE_NATS; before it, each position's
    top log-probabilities within half of that."""
    a, b = int8_out.outputs[0], float_out.outputs[0]
    la, lb = top_logprobs(a.logprobs), top_logprobs(b.logprobs)
    for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        assert all(abs(la[j][t] - lb[j][t]) <= INT8_KV_TIE_NATS / 2 for t in set(la[j]) & set(lb[j])), j
        if x != y:
            break
    assert_same_up_to_near_tie(a.token_ids, la, b.token_ids, lb, tie_nats=INT8_KV_TIE_NATS)


def test_int8_kv_rounds_each_row_to_its_own_grid():
    x = torch.randn(5, 3, 32) * torch.tensor([0.01, 1.0, 100.0])[None, :, None]
    q, s = int8_rows_symmetric(x)
    assert q.dtype == torch.int8 and s.shape == (5, 3) and q.abs().max() <= 127
    assert ((q.float() * s[..., None] - x).abs() <= s[..., None] / 2 + 1e-6).all()
    zq, zs = int8_rows_symmetric(torch.zeros(2, 1, 8))
    assert (zq == 0).all() and (zs == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_backends_attend_over_the_same_int8_cache(dtype):
    """The same tokens written by each backend as two prompts (each attended over its own int8 keys
    and values), then decodes and a short chunk attended: the native kernel against the reference."""
    if "cpu" not in BACKENDS:
        pytest.skip("native CPU kernels did not build here")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, ctx = 4, 2, 64, 37
    outs, prompts = {}, {}
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name)
        cache = allocate_kv_cache(backend, 1, 8, BLOCK, kv_heads, dim, torch.int8)[0]
        assert cache.k_scale is not None and cache.k.dtype == torch.int8
        tables = [[3, 1, 6], [0, 2, 5]]
        g.manual_seed(1)
        k = torch.randn(2 * ctx, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(2 * ctx, kv_heads, dim, generator=g).to(dtype)
        q = torch.randn(2 * ctx, heads, dim, generator=g).to(dtype)
        md = backend.build_metadata([ctx, ctx], [ctx, ctx], tables, BLOCK)  # two prompts: written
        prompts[name] = backend.forward(q, k, v, cache, md, 0.125, None).float()
        md = backend.build_metadata([1, 3], [ctx + 1, ctx + 3], tables, BLOCK)  # decodes, a short chunk
        qd, kd, vd = q[:4] * 0.5, k[:4] * 0.5, v[:4] * 0.5
        outs[name] = backend.forward(qd, kd, vd, cache, md, 0.125, None).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (outs["cpu"] - outs["torch"]).abs().max() < tol
    # The prompts: the reference attends a prompt with nothing cached before it over its fresh keys
    # and values, the native kernel over the cache it just wrote: each against causal attention over
    # those, the fresh ones and the int8 ones dequantized.
    (kq, ks), (vq, vs) = int8_rows_symmetric(k), int8_rows_symmetric(v)
    cached = ((kq.float() * ks[..., None]).to(dtype), (vq.float() * vs[..., None]).to(dtype))
    for name, (keys, values) in (("torch", (k, v)), ("cpu", cached)):
        for rows in (slice(0, ctx), slice(ctx, 2 * ctx)):
            want = attend_chunk(q[rows], keys[rows], values[rows], 0.125, None).float()
            assert (prompts[name][rows] - want).abs().max() < tol, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_kv_keeps_greedy_outputs_and_holds_the_tokens_the_bytes_say(tiny_model_dir, backend):
    model = str(tiny_model_dir("llama"))
    ps = prompts(12, seed=3)
    memory = 64 * 24576
    base = LLM(model, attention_backend=backend, max_model_len=128, kv_cache_memory=memory)
    int8 = LLM(model, attention_backend=backend, max_model_len=128, kv_cache_memory=memory, kv_cache_dtype="int8")
    # float32 model, head_dim 32: a token's K and V of a head take 2 x 128 bytes, or 2 x (32 + 4) in int8
    per_float, per_int8 = 2 * 32 * 4, 2 * (32 + 4)
    ratio = int8.stats().kv_tokens / base.stats().kv_tokens
    assert ratio == pytest.approx(per_float / per_int8, rel=0.01)
    a = base.generate(ps, greedy(), use_tqdm=False)
    b = int8.generate(ps, greedy(), use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert_near(y, x)
    for llm in (base, int8):
        assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_kv_under_preemption_prefix_caching_and_chunking(tiny_model_dir, backend):
    model = str(tiny_model_dir("llama"))
    ps = prompts(10, seed=21)
    common = {"attention_backend": backend, "kv_cache_dtype": "int8", "max_model_len": 128}
    tight = LLM(model, max_num_seqs=8, max_num_batched_tokens=40, kv_cache_memory=5 * 24576, **common)
    roomy = LLM(model, kv_cache_memory=64 * 24576, **common)
    batched = tight.generate(ps + ps[:3], greedy(), use_tqdm=False)  # repeats hit the prefix cache
    assert tight.stats().preemptions > 0 and tight.stats().prefix_cache_hits > 0
    alone = [roomy.generate([p], greedy(), use_tqdm=False)[0] for p in ps]
    # a chunked prompt's later chunks read its earlier K/V from the int8 cache, an unchunked one attends
    # its own float K/V: the same int8 tie applies
    for x, y in zip(batched, alone, strict=False):
        assert_near(x, y)
    for llm in (tight, roomy):
        assert_no_leaks(llm)
