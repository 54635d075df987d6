"""GGUF's Q8_0 / Q4_0 / Q4_1 matrices kept quantized at load (`quantization="auto"`), in either
`gguf_layout`: read into tokenmill's int8 / int4 formats exactly (against the `gguf` package's own
dequantization, not the loader's code), or kept in the file's own blocks; the kept model computing what
the dequantized one does, and the types a config does not map dequantized as before (the engine's map
keeps the K-quants too: test_gguf_kquant_models.py)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from tests.engine.test_engine import assert_no_leaks
from tests.gguf_files import write_gguf
from tests.helpers import PagedRunner, assert_logits_close, assert_same_up_to_near_tie, top_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.linear import LinearBase
from tokenmill.models.config import ModelLoadError
from tokenmill.models.gguf_blocks import decode, pack
from tokenmill.models.loader import load_model
from tokenmill.quant.config import QuantConfig, gguf_methods
from tokenmill.quant.gguf_method import GGUFBlocksMethod, GGUFEmbedding
from tokenmill.quant.int_methods import Int4LinearMethod, Int8LinearMethod
from tokenmill.quant.method import UnquantizedLinearMethod
from tokenmill.quant.quantize import Int4Weight, Int8Weight, QuantSpec, dequantize_int4, dequantize_int8

KEPT = {"Q8_0": Int8Weight, "Q4_0": Int4Weight, "Q4_1": Int4Weight}
IDS = torch.randint(0, 8192, (40,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-kept")
    made: dict[str, object] = {}

    def get(type_name: str):
        if type_name not in made:
            made[type_name] = write_gguf(DEMO_MODEL, folder / f"demo-{type_name}.gguf", type_name)
        return made[type_name]

    return get


def methods(kernels, pin: str | None = None):
    """The GGUF type -> method map the engine builds (`pin`: every product through that kernel)."""
    int8 = Int8LinearMethod(QuantSpec("int8", 32), kernels, prequantized=True)
    int4 = Int4LinearMethod(QuantSpec("int4", 32), kernels, prequantized=True)
    if pin:
        int8.default_kernel = int4.default_kernel = pin
    return {"Q8_0": int8, "Q4_0": int4, "Q4_1": int4}


def kept(gguf) -> QuantConfig:
    """Dense layers, save those whose GGUF type `gguf` maps (the loader reads the file's types)."""
    return QuantConfig(UnquantizedLinearMethod(), gguf=gguf)


def logits(model) -> torch.Tensor:
    return PagedRunner(model, num_blocks=8, block_size=16, block_order=[2, 5, 0, 7, 1, 4, 6, 3]).step({0: IDS})[0]


@pytest.mark.parametrize("type_name", sorted(KEPT))
@pytest.mark.parametrize("shape", [(64, 96), (48, 576)])
def test_blocks_read_as_the_gguf_package_dequantizes_them(type_name, shape):
    rng = np.random.default_rng(len(type_name) + shape[1])
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2, size=(shape[0], 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(shape)
    ours = pack(decode(type_name, raw, shape))
    assert isinstance(ours, KEPT[type_name]) and ours.group == 32
    deq = dequantize_int8(ours, torch.float32) if isinstance(ours, Int8Weight) else dequantize_int4(ours, torch.float32)
    assert np.array_equal(deq.numpy(), reference)  # exact: the same grid


def test_blocks_of_the_wrong_size_are_refused():
    raw = np.zeros((4, 34 * 2), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 data of 272 bytes does not hold a \[4, 96\] matrix"):
        decode("Q8_0", raw, (4, 96))


@pytest.mark.parametrize("type_name", sorted(KEPT))
def test_a_kept_model_computes_what_its_dequantized_weights_do(gguf_file, type_name):
    """Every projection kept in the file's grid (Q/K rows in the Hugging Face order, scales moved with
    them); through the dequantizing kernel the logits are the dequantized model's within float
    rounding, through the native kernels within their activation rounding (int4: int8 in runs of 32)."""
    path = gguf_file(type_name)
    dense = logits(load_model(path, dtype="float32"))
    exact = load_model(path, dtype="float32", quant=kept(methods(None, pin="dequant")))
    layers = [m for name, m in exact.named_modules() if isinstance(m, LinearBase) and name != "lm_head"]
    assert len(layers) == 16 and all(isinstance(getattr(m, "quantized", None), KEPT[type_name]) for m in layers)
    assert not any(n.endswith("weight") and p.numel() == 0 for n, p in exact.named_parameters())  # no placeholders
    assert_logits_close(logits(exact), dense, rel=1e-5)
    if load_cpu_kernels() is not None:
        native = load_model(path, dtype="float32", quant=kept(methods(load_cpu_kernels())))
        # int8: 16-bit activations; int4: int8 activations in runs of 32 (llama.cpp's Q4 path rounds them
        # alike), 4 layers deep: within 4% of the logit scale (measured: 2.7%), and the same top token
        ours = logits(native)
        assert_logits_close(ours, dense, rel=4e-2 if type_name != "Q8_0" else 1e-3)
        assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def blocks_kept(kernels, native_rows: int = 8, prompt: str = "gemm") -> QuantConfig:
    """The engine's map with `gguf_layout` blocks: every product of `native_rows` rows or fewer through
    `gguf_linear`, more through `prompt` (gguf_gemm or the dequantizing path)."""
    methods = gguf_methods(kernels, "blocks")
    method = methods["Q8_0"]
    assert isinstance(method, GGUFBlocksMethod) and methods["Q4_0"] is methods["Q4_1"] is method
    method.max_native_rows, method.prompt_kernel = native_rows, prompt
    return kept(methods)


@pytest.mark.parametrize("type_name", sorted(KEPT))
def test_a_model_kept_in_its_blocks_computes_what_its_dequantized_weights_do(gguf_file, type_name):
    """The file's bytes held as they are (the tied head reading the table's): exact through the
    dequantizing path; through the native kernels (int8 activations in runs of 32, llama.cpp's Q8_0
    activations) within their rounding, the decode product (`gguf_linear`, the 40 rows at once) and
    the prompt product (`gguf_gemm`) giving the same logits."""
    path = gguf_file(type_name)
    dense = logits(load_model(path, dtype="float32"))
    exact = load_model(path, dtype="float32", quant=blocks_kept(None, native_rows=0, prompt="dequant"))
    layers = [m for m in exact.modules() if isinstance(m, LinearBase)]
    assert len(layers) == 17 and all([p.type_name for _, p in m.gguf_parts] == [type_name] for m in layers)
    assert isinstance(exact.embed_tokens, GGUFEmbedding)
    assert exact.lm_head.gguf_parts[0][1].data is exact.embed_tokens.matrix.data  # one copy
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert exact.weight_bytes() <= 1.15 * file_bytes
    assert_logits_close(logits(exact), dense, rel=1e-5)
    kernels = load_cpu_kernels()
    if kernels is not None:
        decode = logits(load_model(path, dtype="float32", quant=blocks_kept(kernels, native_rows=64)))
        prompt = logits(load_model(path, dtype="float32", quant=blocks_kept(kernels)))
        assert torch.equal(prompt, decode)  # the same sums in the same order
        assert_logits_close(decode, dense, rel=4e-2)
        assert (decode.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def test_types_the_config_does_not_keep_are_dequantized_with_a_log_line(gguf_file, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        model = load_model(gguf_file("Q4_K"), dtype="float32", quant=kept(methods(None)))
    assert not any(hasattr(m, "quantized") for m in model.modules())
    assert "GGUF matrices kept quantized: none; dequantized at load to float32: " in caplog.text
    assert "Q4_K" in caplog.text.split("dequantized at load")[1]


def test_a_kept_tensor_that_does_not_fit_names_it(tmp_path):
    path = write_gguf(DEMO_MODEL, tmp_path / "ffn.gguf", "Q8_0", set_keys={"llama.feed_forward_length": 512})
    with pytest.raises(ModelLoadError, match=r"ffn\.gguf: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
        load_model(path, dtype="float32", quant=kept(methods(None)))


@pytest.mark.parametrize(("type_name", "layout"), [("Q8_0", "int"), ("Q4_1", "int"), ("Q8_0", "blocks")])
def test_the_engine_keeps_a_gguf_quantized_by_default(gguf_file, type_name, layout, caplog):
    """`quantization` auto (the default) keeps the file's blocks: fewer weight bytes than `none`,
    and the same greedy tokens up to near ties (int4's activations are rounded to int8)."""
    prompts = ["def fibonacci(n):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
    kwargs = {"dtype": "float32", "kv_cache_memory": 16 * 2**20, "max_num_seqs": 4}
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        kept = LLM(str(gguf_file(type_name)), gguf_layout=layout, **kwargs)
    # 4 layers x 7 projections (a table kept in its blocks: the tied head's and the embedding's, once)
    int_head = type_name == "Q8_0" and layout == "int"
    assert f"GGUF matrices kept quantized: {28 if int_head else 29} {type_name}" in caplog.text
    dense = LLM(str(gguf_file(type_name)), quantization="none", **kwargs)
    assert kept.stats().weight_bytes < dense.stats().weight_bytes
    model = kept.engine.core.worker.runner.model
    if int_head:  # the tied output projection: int8 of its own on the table's grid, exactly
        reader = gguf.GGUFReader(str(gguf_file(type_name)))
        table = next(t for t in reader.tensors if t.name == "token_embd.weight")
        blocks = gguf.quants.dequantize(np.asarray(table.data), table.tensor_type).reshape(8192, 256)
        head = model.lm_head.quantized
        assert isinstance(head, Int8Weight) and head.group == 32
        assert np.array_equal(dequantize_int8(head, torch.float32).numpy(), blocks)
        assert not isinstance(model.embed_tokens, torch.nn.Embedding)  # the dense table dropped
    else:  # a table kept in its blocks, the head reading the same bytes
        assert isinstance(model.embed_tokens, GGUFEmbedding)
        assert model.lm_head.gguf_parts[0][1].data is model.embed_tokens.matrix.data
    outs = kept.generate(prompts, params, use_tqdm=False), dense.generate(prompts, params, use_tqdm=False)
    for a, b in zip(*outs, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        # (int4's and the blocks' int8 activations move this model's logits by up to 0.29: a tie that wide)
        tie = {"tie_nats": 0.3} if type_name == "Q4_1" or layout == "blocks" else {}
        assert_same_up_to_near_tie(x.token_ids, top_logprobs(x.logprobs), y.token_ids, top_logprobs(y.logprobs), **tie)
    assert_no_leaks(kept)
    assert_no_leaks(dense)
