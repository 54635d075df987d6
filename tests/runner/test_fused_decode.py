"""The decoder layers run as one native call (`FusedDecode`) gives the modules' outputs to the bit: the
same kernels in the same order. Steps with a prompt chunk for SDPA still run the modules; models it cannot
run (per-head q/k norms, the torch backend) never get it; the engine's outputs do not change."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks, prompts
from tests.layers.test_cpu_linear import Counting
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.fused_decode import FusedDecode
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model
from tokenmill.quant.cpu_dense import get_dense_linear_method

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels did not build here")
BLOCK = 16


def native_model(folder, dtype, linear="cpu", backend="cpu"):
    attention = get_attention_backend(backend)
    model = load_model(
        folder, dtype=dtype, backend=attention, ops=get_layer_ops("cpu"), linear_method=get_dense_linear_method(linear)
    )
    return model, attention


def run_steps(model, backend, prompt_ids, steps, batch):
    """A prompt per sequence, then `steps` decode steps of `batch` sequences; hidden states of each."""
    cfg = model.config
    per_seq = -(-(len(prompt_ids) + steps + 1) // BLOCK)
    dtype = model.dtype
    caches = allocate_kv_cache(backend, cfg.num_layers, batch * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    n = len(prompt_ids)
    md = backend.build_metadata([n] * batch, [n] * batch, tables, BLOCK)
    ids = torch.tensor(prompt_ids * batch)
    positions = torch.arange(n).repeat(batch)
    outs = [model(ids, positions, caches, md)]
    for s in range(steps):
        length = n + s + 1
        md = backend.build_metadata([1] * batch, [length] * batch, tables, BLOCK)
        ids = torch.arange(batch) * 7 + 11 + s
        outs.append(model(ids, torch.full((batch,), length - 1), caches, md))
    return outs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_layer_equals_the_modules_to_the_bit(tiny_model_dir, arch, dtype):
    folder = tiny_model_dir(arch)
    prompt = list(range(3, 3 + 21))
    for linear in ("cpu", "torch"):  # the native few-row kernel, and torch's GEMM, for every projection
        model, backend = native_model(folder, dtype, linear)
        assert FusedDecode.supports(model)
        modules = run_steps(model, backend, prompt, steps=4, batch=3)
        model.fused_decode = FusedDecode(KERNELS, model)
        model.fused_decode._op = counting = Counting(model.fused_decode._op)
        fused = run_steps(model, backend, prompt, steps=4, batch=3)
        # one call a step for every layer: the 4 decode steps, and the prompt's where the paged kernel
        # attends prompt chunks (else SDPA does, and the prompt runs the modules)
        assert counting.calls == 4 + (backend.prompt_attention == "native")
        for a, b in zip(modules, fused, strict=True):
            assert torch.equal(a, b)


def test_models_it_cannot_run_do_not_get_it(tiny_model_dir):
    assert not FusedDecode.supports(native_model(tiny_model_dir("qwen3"), "float32")[0])  # q/k norms
    assert not FusedDecode.supports(native_model(tiny_model_dir("llama"), "float32", backend="torch")[0])
    llm = LLM(str(tiny_model_dir("qwen3")), max_model_len=64, kv_cache_memory=16 * 24576)
    assert llm.engine.core.worker.runner.model.fused_decode is None


def test_the_engine_gives_the_same_tokens_with_and_without_it(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    ps = prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for fused in (True, False):
        llm = LLM(model, max_model_len=128, kv_cache_memory=64 * 24576, fused_decode=fused)
        assert (llm.engine.core.worker.runner.model.fused_decode is not None) == fused
        outs[fused] = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
        assert_no_leaks(llm)
    assert outs[True] == outs[False]
