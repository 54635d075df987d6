"""Every registered attention backend runs the engine's core cases: the paged forward equals
transformers (a sliding-window family and one with q/k norms included, with each LayerOps), and
batched runs with chunked prefill, preemption and prefix caching equal lone runs token for token."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks, greedy, prompts, same_up_to_near_tie
from tests.helpers import PagedRunner, assert_logits_close
from tokenmill import LLM
from tokenmill.layers.backends import backend_names, get_attention_backend
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model

try:  # the GPU backend runs here under Triton's CPU interpreter (set before triton compiles anything)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401

    TRITON = ["triton"]
except ImportError:
    TRITON = []
BACKENDS = [name for name in backend_names() if name not in ("auto", "triton")] + TRITON  # auto: one of the others
# the interpreter runs a kernel as Python loops (~10 s a forward case): the forward cases on it run in the
# slow run (the default run has its kernels' own tests, test_triton_attention.py); the engine's many-step
# cases on it (minutes interpreted) run
# on a GPU only (`gpu`; they need the engine, whose server packages the lent device lacks: run them
# there with those installed)
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ENGINE_BACKENDS = [pytest.param(b, marks=GPU_ONLY) if b == "triton" else b for b in BACKENDS]


FORWARD_CASES = [
    pytest.param(
        arch,
        backend,
        ops,
        marks=[pytest.mark.slow] if backend == "triton" else [],
    )
    for ops in ("torch", "cpu")
    for backend in BACKENDS
    for arch in ("llama", "mistral", "qwen3")  # mistral: a sliding window; qwen3: q/k norms (and head_dim 48)
]


def test_the_registry_names_its_backends_and_refuses_others(tiny_model_dir):
    assert {"torch", "cpu"} <= set(BACKENDS)
    for name in BACKENDS:
        assert get_attention_backend(name).name == name
    assert get_attention_backend("auto").name == "cpu"  # the kernels build on the machines tests run on
    with pytest.raises(ValueError, match="attention_backend: expected one of auto, cpu, torch, triton"):
        get_attention_backend("flash-on-cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(tiny_model_dir("llama")), attention_backend="flash-on-cpu")


@pytest.mark.parametrize(("arch", "backend", "ops"), FORWARD_CASES)
def test_forward_equals_transformers(tiny_model_dir, hf_logits, backend, arch, ops):
    folder = tiny_model_dir(arch)
    model = load_model(folder, dtype="float32", backend=get_attention_backend(backend), ops=get_layer_ops(ops))
    order = list(range(48))
    random.Random(3).shuffle(order)
    runner = PagedRunner(model, num_blocks=48, block_size=8, block_order=order)
    seqs = {s: torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(s)) for s, n in enumerate((61, 9))}
    logits = {0: [runner.step({0: seqs[0][:40], 1: seqs[1][:1]})[0]], 1: []}
    for t in range(40, 61):  # decodes of both, a prompt chunk of one
        out = runner.step({0: seqs[0][t : t + 1]} | ({1: seqs[1][1:9]} if t == 40 else {}), pad_to=16)
        logits[0].append(out[0])
    assert_logits_close(torch.cat(logits[0]), hf_logits(folder, seqs[0]))


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_engine_core_cases(tiny_model_dir, backend):
    model = str(tiny_model_dir("llama"))
    ps = prompts(12, seed=21)
    tight = LLM(
        model,
        attention_backend=backend,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        kv_cache_memory=12 * 24576,
        max_model_len=128,
    )
    roomy = LLM(model, attention_backend=backend, max_model_len=128, kv_cache_memory=64 * 24576)
    off = LLM(
        model, attention_backend=backend, max_model_len=128, kv_cache_memory=64 * 24576, enable_prefix_caching=False
    )
    batched = tight.generate(ps + ps[:4], greedy(), use_tqdm=False)  # repeats hit the prefix cache
    assert tight.stats().preemptions > 0 and tight.stats().prefix_cache_hits > 0
    alone = [roomy.generate([p], greedy(), use_tqdm=False)[0] for p in ps]
    uncached = off.generate(ps, greedy(), use_tqdm=False)
    for b, a, u in zip(batched, alone, uncached, strict=False):
        assert same_up_to_near_tie(b, a) and same_up_to_near_tie(u, a)
    for b, a in zip(batched[12:], batched[:4], strict=True):
        assert same_up_to_near_tie(b, a)
    for llm in (tight, roomy, off):
        assert_no_leaks(llm)


def test_auto_runs_the_reference_where_the_native_kernels_do_not_and_cpu_says_so(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    llm = LLM(model, dtype="float16", max_model_len=64, kv_cache_memory=16 * 12288)  # the kernels: fp32, bf16
    worker = llm.engine.core.worker
    assert worker.backend.name == "torch" and worker.runner.model.ops.name == "torch"
    assert len(llm.generate([[5, 6, 7]], greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    for field in ("attention_backend", "layer_ops"):
        with pytest.raises(ValueError, match=f"{field}: 'cpu' runs float32 and bfloat16 on a CPU device, not"):
            LLM(model, dtype="float16", max_model_len=64, kv_cache_memory=16 * 12288, **{field: "cpu"})
    native = LLM(model, max_model_len=64, kv_cache_memory=16 * 24576).engine.core.worker
    assert native.backend.name == "cpu" and native.runner.model.ops.name == "cpu"
