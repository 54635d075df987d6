"""`--quantization int8` / `int4` kept in GGUF blocks (quant/int_blocks.py): the Q8_0 quantizer writes the
bytes the `gguf` package writes, bit for bit, and the Q4_1 one tokenmill's int4 values; a model's
projections hold the blocks (repacked in 16-row groups,
forced on here so that a CPU without AVX-512 VNNI tests the scalar form) and compute what the dense
model holding the dequantized weights does within the int8 rounding of the activations; the fused
decode chains them to the bit; a layer no block fits is quantized per channel; the quantized-weight
cache reads them back exactly; and which CPU kinds take the blocks by default."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.runner.test_fused_decode import run_steps
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.kernels.defaults import CpuKind
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.fused_decode import FusedDecode
from tokenmill.layers.linear import Linear, LinearBase
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model
from tokenmill.quant.config import QuantSettings, in_blocks
from tokenmill.quant.gguf_method import GGUFMatrix, dequantize
from tokenmill.quant.int_blocks import BlocksQuantMethod
from tokenmill.quant.quantize import (
    Int8Weight,
    QuantSpec,
    dequantize_int4,
    quantize_int4,
    quantize_q4_1,
    quantize_q8_0,
)

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels did not build here")
METHODS = {"int8": "Q8_0", "int4": "Q4_1"}  # the quantization -> its block type


def test_the_q8_0_quantizer_writes_ggufs_bytes():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 256)) * rng.uniform(0.01, 4, (40, 1))).astype(np.float32)
    w[3, 32:64] = 0.0  # a block of zeros: scale 0
    w[5, :32] = np.arange(-16, 16, dtype=np.float32) + 0.5  # ties at d = 1 ...
    w[5, 0] = -127.0  # ... (max |w| 127): half away from zero, as roundf
    expected = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize_q8_0(torch.from_numpy(w)).numpy(), expected)
    assert np.array_equal(quantize_q8_0(torch.from_numpy(w).to(torch.bfloat16)).numpy(),
                          gguf.quants.quantize(torch.from_numpy(w).to(torch.bfloat16).float().numpy(),
                                               gguf.GGMLQuantizationType.Q8_0))  # fmt: skip
    with pytest.raises(ValueError, match="not a whole number"):
        quantize_q8_0(torch.zeros(4, 48))


def test_the_q4_1_blocks_hold_int4s_values():
    rng = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=rng) * torch.rand(48, 1, generator=rng) * 3
    w[2, :32] = 0.0  # a group of one value: scale 0
    blocks = GGUFMatrix("Q4_1", quantize_q4_1(w), 256)
    values = dequantize(blocks, None, torch.float32)  # (the `gguf` package's dequantizer)
    assert torch.equal(values, dequantize_int4(quantize_int4(w, 32), torch.float32))
    with pytest.raises(ValueError, match="not a whole number"):
        quantize_q4_1(torch.zeros(4, 48))


def blocks_model(folder, quantization, dtype="float32"):
    backend = get_attention_backend("cpu")
    method = BlocksQuantMethod(QuantSpec(quantization, 32), KERNELS, repack16=True)
    model = load_model(folder, dtype=dtype, backend=backend, ops=get_layer_ops("cpu"), linear_method=method)
    return model, backend, method


def round_per_32(x: torch.Tensor) -> torch.Tensor:  # [..., K]: each run of 32 to int8 steps of max |x| / 127
    runs = x.reshape(*x.shape[:-1], -1, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)  # (times 127 / max, as the kernel)
    return (torch.round(runs * inv) * (amax / 127)).reshape(x.shape)


def dequantized_twin(folder, quantized, backend):
    """The dense model holding the quantized model's dequantized weights, each projection's input rounded
    per 32 as the Q8_0 kernels round it (the products then differ only in float32 summation order)."""
    dense = load_model(folder, dtype="float32", backend=backend)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, LinearBase)}
    for name, module in dense.named_modules():
        if isinstance(module, LinearBase):
            module.weight.data.copy_(dequantize(layers[name].quantized, KERNELS.ops, torch.float32))
    method = dense.layers[0].mlp.down_proj.linear_method  # (one instance for every dense layer)
    apply = method.apply
    method.apply = lambda layer, x, bias: apply(layer, round_per_32(x), bias)
    if quantized.config.tie_word_embeddings:  # the twin's head is its table, read by compute_logits
        dense.embed_tokens.weight.data.copy_(dequantize(layers["lm_head"].quantized, KERNELS.ops, torch.float32))
        logits = dense.compute_logits
        dense.compute_logits = lambda hidden: logits(round_per_32(hidden))
    return dense


@needs_kernels
@pytest.mark.parametrize(
    ("arch", "tied", "quantization"), [("llama", True, "int8"), ("qwen2", False, "int8"), ("llama", True, "int4")]
)
def test_a_model_in_blocks_computes_what_its_dequantized_weights_do(tiny_model_dir, arch, tied, quantization):
    folder = tiny_model_dir(arch, tied)
    model, backend, _ = blocks_model(folder, quantization)
    type_name = METHODS[quantization]
    dense = load_model(folder, dtype="float32")
    weights = {n: p.data for n, p in dense.named_parameters()}
    weights.setdefault("lm_head.weight", weights["embed_tokens.weight"])  # a tied head: the table's rows
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase):
            m = layer.quantized
            assert isinstance(m, GGUFMatrix) and m.type_name == type_name and m.repacked, name
            quantize = quantize_q8_0 if type_name == "Q8_0" else quantize_q4_1
            file_blocks = GGUFMatrix(type_name, quantize(weights[f"{name}.weight"]), m.cols)
            assert torch.equal(dequantize(m, KERNELS.ops, torch.float32), dequantize(file_blocks, None, torch.float32))
    assert model.weight_bytes() < (0.6 if quantization == "int8" else 0.45) * dense.weight_bytes()
    twin_backend = get_attention_backend("cpu")
    twin = dequantized_twin(folder, model, twin_backend)
    ids = list(range(3, 3 + 19))
    steps = zip(run_steps(model, backend, ids, 3, 2), run_steps(twin, twin_backend, ids, 3, 2), strict=True)
    for i, (a, b) in enumerate(steps):
        la, lb = model.compute_logits(a), twin.compute_logits(b)
        err = (la - lb).abs().amax(-1) / lb.abs().amax(-1)  # [rows]
        # the sums differ in float32 order only, until an activation at a rounding tie goes the other way
        # (once in some 10^5 roundings) and moves by a step: that row and, through attention, the later
        # ones then differ by about a percent in this random model
        assert err.max() < 4e-2
        if i == 0:  # the prompt: its first positions (before any such tie) agree to float32 order
            assert (err < 1e-5).sum() >= 8, err


@needs_kernels
@pytest.mark.parametrize(("quantization", "dtype"), [("int8", "float32"), ("int8", "bfloat16"), ("int4", "bfloat16")])
def test_the_fused_stack_chains_the_blocks_to_the_bit(tiny_model_dir, quantization, dtype):
    folder = tiny_model_dir("qwen2")  # q/k/v biases too
    model, backend, method = blocks_model(folder, quantization, dtype)
    assert FusedDecode.supports(model)
    prompt = list(range(5, 5 + 17))
    modules = run_steps(model, backend, prompt, 3, 3)
    model.fused_decode = FusedDecode(KERNELS, model)
    fused = run_steps(model, backend, prompt, 3, 3)
    for a, b in zip(modules, fused, strict=True):
        assert torch.equal(a, b)
    method.plan = {shape: ("dequant",) * 9 for shape in [(256, 128), (128, 128), (704, 128), (128, 352)]}
    assert model.fused_decode.plan(torch.zeros(3, 128), backend.build_metadata([1] * 3, [9] * 3, [[0]] * 3, 16)) is None


@needs_kernels
def test_a_layer_no_block_fits_is_quantized_per_channel():
    method = BlocksQuantMethod(QuantSpec("int8", 32), KERNELS)
    layer = Linear(48, 32, linear_method=method, bias=True)
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(32))
    layer.process_weights_after_loading()
    assert isinstance(layer.quantized, Int8Weight) and layer.quantized.group == 48
    x = torch.randn(5, 48)
    expected = F.linear(x, w, layer.bias)
    assert (layer(x) - expected).abs().max() < 2e-2 * expected.abs().max()
    rows = method.rows(layer, torch.tensor([3, 0]), torch.float32)
    assert (rows - w[[3, 0]]).abs().max() <= w.abs().max() / 127


def test_which_cpu_kinds_keep_int8_and_int4_in_blocks():
    zen4 = CpuKind(avx512=True, vnni=True, bf16=True, amx=False)
    amx = CpuKind(avx512=True, vnni=True, bf16=True, amx=True)
    avx2 = CpuKind(avx512=False, vnni=False, bf16=False, amx=False, avx2=True)
    older = CpuKind(avx512=False, vnni=False, bf16=False, amx=False)
    for q in ("int8", "int4"):
        assert in_blocks(QuantSettings(q), zen4)
        assert in_blocks(QuantSettings(q, group_size=32), zen4)
        assert not in_blocks(QuantSettings(q, group_size=64), zen4)  # another grid: tokenmill's format
        assert not in_blocks(QuantSettings(q, gguf_layout="int"), zen4)  # asked for the int formats
        assert not in_blocks(QuantSettings(q), amx)  # not measured there: the int kernels stay
        assert not in_blocks(QuantSettings(q, gguf_layout="blocks"), older)  # no vector form of the blocks
    # AVX2: int4 in Q4_1 blocks (16-row groups) under auto (`blocks` there); int8 keeps its int kernels
    assert in_blocks(QuantSettings("int4"), avx2) and not in_blocks(QuantSettings("int4", gguf_layout="int"), avx2)
    assert not in_blocks(QuantSettings("int8"), avx2)
    assert not in_blocks(QuantSettings("int8", gguf_layout="blocks"), avx2)
    assert in_blocks(QuantSettings("int8", gguf_layout="q8_0"), zen4)  # q8_0: Q8_0 alone in blocks
    assert not in_blocks(QuantSettings("int4", gguf_layout="q8_0"), zen4)
    assert not in_blocks(QuantSettings("w8a8"), zen4)


@needs_kernels
def test_float16_layers_hold_blocks_and_run_them_dequantized():
    """The block kernels take float32 and bfloat16 activations: a float16 layer multiplies its
    dequantized blocks (torch's GEMM) and is not chained by the fused decode."""
    method = BlocksQuantMethod(QuantSpec("int4", 32), KERNELS)
    layer = Linear(64, 32, linear_method=method, dtype=torch.float16)
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    layer.weight.data.copy_(w)
    layer.process_weights_after_loading()
    assert isinstance(layer.quantized, GGUFMatrix) and not method.fusable(layer)
    x = torch.randn(3, 64, dtype=torch.float16)
    dense = dequantize(layer.quantized, KERNELS.ops, torch.float32).half()
    assert torch.equal(layer(x), F.linear(x, dense))
