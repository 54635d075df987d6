"""GGUF files of llama.cpp's Q4_K_M / Q5_K_M mixes kept quantized at load (`quantization` auto): every
projection, the embedding table and the output projection (tied or not) in the file's blocks or
tokenmill's int formats, nothing dequantized at load; the kept model computing what the model with
weights dequantized by the `gguf` package does (exactly through the dequantizing path, within the int8
activations' rounding through the decode kernels); the engine generating the same tokens."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from tests.engine.test_engine import assert_no_leaks
from tests.gguf_files import q4_k_m_types, write_gguf
from tests.helpers import PagedRunner, assert_logits_close, assert_same_up_to_near_tie, top_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.linear import LinearBase
from tokenmill.models.loader import load_model
from tokenmill.quant.config import QuantConfig, gguf_methods
from tokenmill.quant.gguf_method import GGUFBlocksMethod, GGUFEmbedding, dequantize
from tokenmill.quant.method import UnquantizedLinearMethod

IDS = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    """name -> a GGUF file: the demo model (widths 256 and 768) tied as Q4_K_M and untied as Q5_K_M;
    the tiny Qwen2 (widths 128 and 352: llama.cpp's fallbacks; q/k/v biases) untied as Q4_K_M."""
    folder = tmp_path_factory.mktemp("gguf-kquants")
    return {
        "demo-q4_k_m": write_gguf(DEMO_MODEL, folder / "demo-q4_k_m.gguf", q4_k_m_types("Q4_K", tied=True)),
        "demo-q5_k_m-untied": write_gguf(DEMO_MODEL, folder / "demo-q5_k_m.gguf", q4_k_m_types("Q5_K"), untie=True),
        "tiny-q4_k_m": write_gguf(
            tiny_model_dir("qwen2"), folder / "tiny-q4_k_m.gguf", q4_k_m_types("Q4_K"), arch="qwen2"
        ),
    }


def kept(native: bool, max_native_rows: int = 64, layout: str = "int") -> QuantConfig:
    """The engine's GGUF methods (Q8_0 / Q4_x by `layout`); `native` False: every product through the
    dequantizing paths (the int methods pinned to theirs, the blocks method with no native rows)."""
    kernels = load_cpu_kernels()
    methods = gguf_methods(kernels, layout, repack=None if native else False)  # (file blocks: the reference)
    for m in methods.values():
        if isinstance(m, GGUFBlocksMethod):
            m.max_native_rows = max_native_rows if native else 0
            m.prompt_kernel = "gemm" if native else "dequant"
        elif not native:
            m.default_kernel = "dequant"  # type: ignore[attr-defined]
    return QuantConfig(UnquantizedLinearMethod(), gguf=methods)


def logits(model) -> torch.Tensor:
    ids = IDS % model.config.vocab_size
    return PagedRunner(model, num_blocks=8, block_size=16, block_order=[2, 5, 0, 7, 1, 4, 6, 3]).step({0: ids})[0]


def file_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("name", ["demo-q4_k_m", "demo-q5_k_m-untied", "tiny-q4_k_m"])
def test_every_matrix_stays_quantized_and_computes_the_dequantized_model(files, name, caplog):
    path = files[name]
    types = set(file_types(path).values()) - {"F32"}
    assert types <= {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"} and len(types) >= 2
    dense = load_model(path, dtype="float32")  # every matrix dequantized by gguf at load
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        exact = load_model(path, dtype="float32", quant=kept(native=False))
    assert "dequantized at load to float32: none" in caplog.text
    layers = [m for m in exact.modules() if isinstance(m, LinearBase)]
    assert all(hasattr(m, "gguf_parts") or hasattr(m, "quantized") for m in layers)
    assert not any(n.endswith("weight") and p.numel() == 0 for n, p in exact.named_parameters())  # no placeholders
    table = exact.embed_tokens
    if file_types(path)["token_embd.weight"] != "Q8_0" or not exact.config.tie_word_embeddings:
        assert isinstance(table, GGUFEmbedding)
        ref = dense.embed_tokens.weight if hasattr(dense, "embed_tokens") else None
        ids = torch.tensor([0, 7, 4095])
        assert torch.equal(table(ids), ref[ids])  # the table's rows: gguf's values exactly
    if exact.config.tie_word_embeddings:  # the head reads the table's own blocks: one copy
        assert exact.lm_head.gguf_parts[0][1].data is table.matrix.data
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert exact.weight_bytes() <= 1.15 * file_bytes < dense.weight_bytes()
    reference = logits(dense)
    assert_logits_close(logits(exact), reference, rel=1e-5)
    if load_cpu_kernels() is not None:  # the decode kernels on the 40-token prompt: int8 activations
        ours = logits(load_model(path, dtype="float32", quant=kept(native=True)))
        # (one int8 scale per 256 activations for the K-quants, llama.cpp's Q8_K: the files here reach
        # 3-5% of the logit scale, where one scale per 32 reached 2-4%)
        assert_logits_close(ours, reference, rel=6e-2)
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
        # the prompt product (gguf_gemm, past 8 rows): the decode kernels' sums, so the same logits
        prompt = logits(load_model(path, dtype="float32", quant=kept(native=True, max_native_rows=8)))
        assert torch.equal(prompt, ours)


def test_mixed_fused_layers_keep_one_matrix_per_type(files):
    model = load_model(files["demo-q4_k_m"], dtype="float32", quant=kept(native=False))
    qkv = model.layers[0].self_attn.qkv_proj
    assert [(start, m.type_name) for start, m in qkv.gguf_parts] == [(0, "Q4_K"), (256 + 64, "Q6_K")]
    gate_up = model.layers[0].mlp.gate_up_proj
    assert [(start, m.type_name) for start, m in gate_up.gguf_parts] == [(0, "Q4_K")]  # joined
    reader = gguf.GGUFReader(str(files["demo-q4_k_m"]))
    v = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    ref = gguf.quants.dequantize(np.asarray(v.data), v.tensor_type)  # (v's rows are not permuted)
    assert np.array_equal(dequantize(qkv.gguf_parts[1][1], None, torch.float32).numpy(), ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_serves_a_q4_k_m_file_kept_quantized(files, dtype, caplog):
    prompts = ["def fibonacci(n):", "import os\n", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5)
    kwargs = {"dtype": dtype, "kv_cache_memory": 16 * 2**20, "max_num_seqs": 4}
    path = str(files["demo-q4_k_m"])
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        kept_llm = LLM(path, **kwargs)
    assert "GGUF matrices kept quantized: 20 Q4_K, 9 Q6_K; dequantized at load" in caplog.text
    assert "GGUF blocks in 16-row groups: " in caplog.text  # (which: the CPU kind's rule, next test)
    dense_llm = LLM(path, quantization="none", **kwargs)
    assert kept_llm.stats().weight_bytes * 2.5 < dense_llm.stats().weight_bytes  # (4.5 and 6.6 bits a weight)
    outs = kept_llm.generate(prompts, params, use_tqdm=False), dense_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(*outs, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        # (int8 activations in the decode steps, bfloat16 rounding: ties this wide are near)
        assert_same_up_to_near_tie(
            x.token_ids, top_logprobs(x.logprobs), y.token_ids, top_logprobs(y.logprobs), tie_nats=0.3
        )
    assert_no_leaks(kept_llm)
    assert_no_leaks(dense_llm)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="native CPU kernels did not build here")
@pytest.mark.parametrize(
    ("name", "layout"), [("demo-q4_k_m", "int"), ("tiny-q4_k_m", "int"), ("tiny-q4_k_m", "blocks")]
)
def test_the_fused_decode_runs_the_blocks_as_the_modules_do(files, name, layout):
    # (demo: q/k Q4_K beside v Q6_K; tiny: llama.cpp's fallbacks, Q5_0 beside Q8_0, q/k/v biases, the down
    # projections in int8, or in their Q8_0 blocks)
    from tests.layers.test_cpu_linear import Counting
    from tests.runner.test_fused_decode import run_steps
    from tokenmill.layers.backends import get_attention_backend
    from tokenmill.layers.fused_decode import FusedDecode
    from tokenmill.layers.ops import get_layer_ops

    backend = get_attention_backend("cpu")
    model = load_model(
        files[name], dtype="float32", quant=kept(True, 8, layout), backend=backend, ops=get_layer_ops("cpu")
    )
    assert FusedDecode.supports(model)
    assert len(model.layers[0].self_attn.qkv_proj.gguf_parts) == 2  # (two runs of two types)
    prompt = list(range(3, 3 + 21))
    modules = run_steps(model, backend, prompt, steps=4, batch=3)
    model.fused_decode = FusedDecode(load_cpu_kernels(), model)
    model.fused_decode._op = counting = Counting(model.fused_decode._op)
    fused = run_steps(model, backend, prompt, steps=4, batch=3)
    assert counting.calls == 4  # every decode step in one call; the prompt ran the modules
    for a, b in zip(modules, fused, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("repack", ["x16", "file"])
def test_the_start_up_log_says_which_blocks_were_repacked(files, repack, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        LLM(str(files["demo-q4_k_m"]), gguf_repack=repack, kv_cache_memory=16 * 2**20, max_num_seqs=2)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF blocks in 16-row"))
    repacked, stored = (part.split(": ")[1] for part in line.split("; "))
    assert (repacked == "none") == (repack == "file") and (stored == "none") == (repack == "x16"), line
    assert "Q4_K" in (repacked if repack == "x16" else stored) and "Q6_K" in line
