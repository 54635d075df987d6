"""Quantized linear methods: the formats round-trip within their grids, every kernel computes the product
of the dequantized weights, group sizes are applied as asked (or refused naming the layer), a
quantized model's logits equal those of the dense model holding the dequantized weights, the fused
decode stack gives the modules' outputs to the bit, and the engine runs them without leaking blocks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_engine import assert_no_leaks, prompts
from tests.runner.test_fused_decode import run_steps
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.fused_decode import FusedDecode
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model
from tokenmill.quant.config import QuantSettings, in_blocks
from tokenmill.quant.int_methods import QuantizedLinearMethod, get_quant_method
from tokenmill.quant.quantize import (
    Int4PackWeight,
    Int4Weight,
    QuantSpec,
    choose_group,
    dequantize_int4,
    dequantize_int4pack,
    dequantize_int8,
    int4_scales,
    int4_values,
    quantize_int4,
    quantize_int4pack,
    quantize_int8,
    unpack_int4,
    unpack_int4pack,
)

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels did not build here")
METHODS = ("int8", "w8a8", "int4")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("group", [32, 128, 512])
def test_int8_rounds_to_the_nearest_point_of_its_grid(group):
    w = weights(96, 512)
    q = quantize_int8(w, group)
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127 and q.scales.shape == (96, 512 // group)
    step = q.scales.repeat_interleave(group, dim=1)  # [N, K]: each weight's grid step
    assert ((dequantize_int8(q, torch.float32) - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(q.wsums, q.q.sum(1, dtype=torch.int32))


@pytest.mark.parametrize(("k", "group"), [(96, 32), (128, 64), (352, 32)])
def test_int4_round_trips_through_both_layouts(k, group):
    w = weights(128, k)
    q = int4_values(w, group)[0]
    ours, torchs = quantize_int4(w, group), quantize_int4pack(w, group)
    assert ours.packed.shape == (128 // 16, k // 8, 64) and ours.shape == (128, k)
    assert torch.equal(unpack_int4(ours), q)
    assert torch.equal(unpack_int4pack(torchs), q)  # the layout the dequantize path reads is torch's own
    scales, mins = int4_scales(ours)
    step = scales.float().repeat_interleave(group, dim=1)
    low = mins.float().repeat_interleave(group, dim=1)
    # within half a step of the grid, plus float16's rounding (2^-11) of the minimum and of 15 steps
    assert ((dequantize_int4(ours, torch.float32) - w).abs() <= step / 2 + 2**-11 * (low.abs() + 15 * step)).all()
    # torch's: within half a step of the grid, plus the bfloat16 rounding of its scale and zero
    assert ((dequantize_int4pack(torchs, torch.float32) - w).abs() <= step / 2 + 0.01 * w.abs().amax()).all()
    with pytest.raises(ValueError, match="64 at a time; this layer has 96"):
        quantize_int4pack(weights(96, 64), 32)


def reference_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4's grid the plain way, a group at a time: (q [N, K], scale, min [N, K / group] float16)."""
    g = w.float().reshape(w.shape[0], -1, group)
    low, high = g.min(-1).values, g.max(-1).values
    s = ((high - low) / 15).half().float()
    low = low.half().float()
    q = ((g - low[..., None]) / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().clamp(0, 15)
    return q.reshape(w.shape).to(torch.uint8), s.half(), ((low + 8 * s) - 8 * s).half()


def reference_pack(q: torch.Tensor) -> torch.Tensor:
    """tokenmill's int4 layout byte by byte (Int4Weight's docstring): q [N, K] -> [T, K / 8, 64]."""
    n, k = q.shape
    tiles = -(-n // 16)
    out = torch.zeros(tiles, k // 8, 64, dtype=torch.uint8)
    padded = torch.zeros(tiles * 16, k, dtype=torch.uint8)
    padded[:n] = q
    for i, j in itertools.product(range(16), range(4)):
        rows = padded[i::16]  # row 16t + i of every tile t: [T, K]
        out[:, :, 4 * i + j] = rows[:, j::8] | (rows[:, 4 + j :: 8] << 4)
    return out


@pytest.mark.parametrize(("n", "k", "group"), [(37, 96, 32), (128, 256, 64), (16, 32, 32), (50, 2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_quantizers_equal_the_plain_computation_bit_for_bit(n, k, group, dtype):
    """The blocked, in-place quantizers (row blocks, int8 stores, a word-wide nibble pack) give the
    bits of the plain computation: every group's range, its rounding, the layout's bytes."""
    w = (weights(n, k, seed=n + k) * torch.rand(n, 1, generator=torch.Generator().manual_seed(1)) * 40).to(dtype)
    w[0] = 0  # a zero row: scale 0, every value at the minimum
    w[1, :32] = 0.5  # a constant group
    q, scale, low = reference_int4(w, group)
    ours = quantize_int4(w, group)
    assert torch.equal(ours.packed, reference_pack(q)) and torch.equal(unpack_int4(ours), q.int())
    got_scale, got_min = int4_scales(ours)
    assert torch.equal(got_scale, scale) and torch.equal(got_min, low)
    int8 = quantize_int8(w, group)
    g = w.float().reshape(n, -1, group)
    step = torch.maximum(-g.min(-1).values, g.max(-1).values) / 127
    expect = (g / step.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-127, 127)
    assert torch.equal(int8.scales, step) and torch.equal(int8.q, expect.reshape(n, k).to(torch.int8))


@needs_kernels
@pytest.mark.parametrize(("n", "k", "group"), [(37, 96, 32), (128, 256, 64), (50, 2048, 2048), (16, 512, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_dequantizers_write_the_torch_expressions_values(n, k, group, dtype):
    """A prompt chunk's dense copy from the native kernels (one pass a row) holds the bits of
    `dequantize_int8` / `dequantize_int4`: float32 q * scale (+ min), rounded as torch rounds; int4 with
    float16 and float32 scales and mins, a last tile of padding rows."""
    w = weights(n, k, seed=n + k) * 3
    int8 = quantize_int8(w, group)
    out = torch.empty(n, k, dtype=dtype)
    KERNELS.ops.dequant_int8(out, int8.q, int8.scales, int8.group)
    assert torch.equal(out, dequantize_int8(int8, dtype))
    if group % 32:
        return
    int4 = quantize_int4(w, group)
    for v in (
        int4,
        dataclasses.replace(int4, mins=int4.mins.float()),
        dataclasses.replace(int4, scales=int4.scales.float(), mins=int4.mins.float()),
    ):
        out = torch.full((n, k), float("nan"), dtype=dtype)
        KERNELS.ops.dequant_int4(out, v.packed, v.scales, v.mins, v.group)
        assert torch.equal(out, dequantize_int4(v, dtype))
    with pytest.raises(RuntimeError, match="dequant_int8: out must be contiguous"):
        KERNELS.ops.dequant_int8(torch.empty(n, k + 1, dtype=dtype), int8.q, int8.scales, int8.group)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_layers_quantized_on_several_threads_equal_one_threads(tiny_model_dir, name):
    folder = tiny_model_dir("llama")
    method = get_quant_method(QuantSpec(name), KERNELS)
    one = load_model(folder, dtype="bfloat16", linear_method=method, workers=1)
    four = load_model(folder, dtype="bfloat16", linear_method=method, workers=4)
    layers = dict(four.quantized_layers())
    assert len(layers) > 8
    for layer_name, layer in one.quantized_layers():
        for field in dataclasses.fields(layer.quantized):
            a, b = getattr(layer.quantized, field.name), getattr(layers[layer_name].quantized, field.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (layer_name, field.name)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: "):  # the first in module order
        load_model(folder, linear_method=get_quant_method(QuantSpec("int8", 64), KERNELS), workers=4)


def test_group_sizes_are_applied_or_refused_naming_the_layer():
    assert choose_group(QuantSpec("int8"), 352, "x") == 352  # per channel
    assert choose_group(QuantSpec("int4"), 352, "x") == 32
    assert choose_group(QuantSpec("int8", 32), 352, "x") == 32
    with pytest.raises(ValueError, match=r"^quantization_group_size: 128 does not divide the input width 1376 of down"):
        choose_group(QuantSpec("int4", 128), 1376, "down")
    assert choose_group(QuantSpec("int4", 128, group_fallback=True), 1376, "down") == 32
    assert choose_group(QuantSpec("int4", 128, group_fallback=True), 576, "o") == 64
    with pytest.raises(ValueError, match="power of two from 32"):
        choose_group(QuantSpec("int8", 48), 576, "o")
    with pytest.raises(ValueError, match="w8a8 quantizes per output channel only"):
        choose_group(QuantSpec("w8a8", 32), 576, "o")


# ----------------------------------------------------------------------------- kernels


def dequantize(w: object, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, Int4Weight):
        return dequantize_int4(w, dtype)
    if isinstance(w, Int4PackWeight):
        return dequantize_int4pack(w, dtype)
    return dequantize_int8(w, dtype)  # type: ignore[arg-type]


def reference(method: QuantizedLinearMethod, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 product of the dequantized weights (W8A8: of the per-row quantized x too)."""
    dense = dequantize(w, torch.float32)
    if method.name == "w8a8":
        xf = x.float()
        amax = xf.abs().amax(1, keepdim=True)
        x = torch.round(xf * 127 / amax) * amax / 127
    return F.linear(x.float(), dense, None if bias is None else bias.float())


def int4_native_reference(w: Int4Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the native int4 kernel computes: x rounded to int8 in runs of 32 (one scale a run, as
    llama.cpp's Q8_0 activations) against q * scale, plus min * (each group's exact sum of x)."""
    n, k = w.shape
    runs = x.float().reshape(x.shape[0], k // 32, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = (torch.round(runs / scale) * scale).reshape(x.shape[0], k)
    scales, mins = (t.float() for t in int4_scales(w))
    q = unpack_int4(w).float().reshape(n, k // w.group, w.group)
    steps = (q * scales[..., None]).reshape(n, k)
    mins = mins.repeat_interleave(w.group, dim=1)
    return xq @ steps.t() + x.float() @ mins.t() + (0 if bias is None else bias.float())


@needs_kernels
@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_computes_the_product_of_the_dequantized_weights(name, dtype):
    group = None if name != "int4" else 32
    method = get_quant_method(QuantSpec(name, group), KERNELS)
    for n, k, grp in (
        (128, 352, group),
        (40, 352, group),  # (int4: a last tile of 8 rows and 8 of padding)
        (192, 512, None if name == "w8a8" else 64),
        (64, 1024, None if name == "w8a8" else 256),
        (64, 100, None),
    ):
        if name == "int4" and k % 32:
            continue
        w0 = method.quantize(weights(n, k, seed=n), grp or choose_group(QuantSpec(name), k, "t"))
        bias = (torch.randn(n) * 0.1).to(dtype)
        # int4: scales and minimums in float16 (quantized here, GGUF), minimums in float32 (AWQ / GPTQ
        # checkpoints), both in float32 (compressed-tensors checkpoints)
        variants = [w0]
        if isinstance(w0, Int4Weight):
            variants += [dataclasses.replace(w0, mins=w0.mins.float())]
            variants += [dataclasses.replace(w0, scales=w0.scales.float(), mins=w0.mins.float())]
        for w, rows in itertools.product(variants, (1, 3, 8, 11, 70)):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            for kernel_name, kernel in method.kernels(dtype).items():
                out = kernel(w, x, bias)
                if kernel_name in ("native", "gemm") and name == "int4":
                    ref = int4_native_reference(w, x, bias)
                else:
                    ref = reference(method, w, x, bias)
                assert out.dtype == dtype and out.shape == (rows, n)
                # float32: int8's 16-bit fixed-point activations (under 2^-15 of a row's largest value),
                # int4's summation order; bfloat16, and int4's bfloat16 kernel: the output's rounding
                tol = 3e-4 if dtype == torch.float32 and kernel_name != "int4pack" else 2e-2
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < tol, (name, kernel_name, n, k, rows, err)


def int8_gemm_reference(w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What int8's `gemm` computes: x rounded to int8 in runs of 256 k (the last run shorter), one scale
    a run, against q * scale, in float64."""
    xq, scale = [], []
    for r in torch.split(x.float(), 256, dim=1):  # (in float32, as the kernel rounds)
        amax = r.abs().amax(1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        xq.append(torch.round(r * inv).double())
        scale.append((amax / 127).double().expand(-1, r.shape[1]))
    dense = dequantize(w, torch.float32).double()
    return (torch.cat(xq, 1) * torch.cat(scale, 1)) @ dense.t() + (0 if bias is None else bias.double())


@pytest.mark.skipif(KERNELS is None or not KERNELS.ops.int8_gemm_built(), reason="int8 gemm: AVX-512 VNNI builds")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8s_many_row_kernel_is_the_product_with_int8_runs_of_x(dtype):
    """int8's prompt kernel on AVX-512 VNNI: rows across its blocks of 96 and tiles of 3, weight rows past
    a whole tile of 4, a last run of x shorter than 256, a row of zeros, bias; against the float64
    product of the rounded runs. An input width off the 64-k steps takes the dequantizing product."""
    method = get_quant_method(QuantSpec("int8", None), KERNELS)
    gemm = method.kernels(dtype)["gemm"]
    for n, k in ((38, 320), (64, 2048), (130, 576)):
        w = method.quantize(weights(n, k, seed=n), k)
        bias = (torch.randn(n) * 0.1).to(dtype)
        for rows in (1, 3, 50, 100, 200):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            x[0] = 0
            out = gemm(w, x, bias)
            ref = int8_gemm_reference(w, x.float(), bias.float())
            assert out.dtype == dtype and out.shape == (rows, n)
            tol = 1e-5 if dtype == torch.float32 else 8e-3  # float32: summation order; bfloat16: the output's rounding
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, (n, k, rows, err)
    w = method.quantize(weights(16, 100, seed=1), 100)
    x = torch.randn(70, 100).to(dtype)
    assert torch.equal(gemm(w, x, None), method.kernels(dtype)["dequant"](w, x, None))


@needs_kernels
def test_int4s_float32_kernel_is_the_float32_product_rounded_once():
    # bfloat16 rows through float32 weights and GEMM (the many-row kernel without bfloat16 arithmetic):
    # the float32 reference's own product, rounded to bfloat16 once at the end
    method = get_quant_method(QuantSpec("int4", 32), KERNELS)
    assert "dequant32" in method.kernels(torch.bfloat16) and "dequant32" not in method.kernels(torch.float32)
    w = method.quantize(weights(96, 256, seed=3), 32)
    bias = (torch.randn(96) * 0.1).to(torch.bfloat16)
    for rows in (9, 70):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = method.kernels(torch.bfloat16)["dequant32"](w, x, bias)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, reference(method, w, x, bias).to(torch.bfloat16))


# ----------------------------------------------------------------------------- models


def dequantized_twin(folder, quantized, dtype, backend):
    """The dense model holding the quantized model's dequantized weights (the reference)."""
    dense = load_model(folder, dtype=dtype, backend=backend)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, LinearBase)}
    for name, module in dense.named_modules():
        if isinstance(module, LinearBase):
            q = layers[name].quantized
            module.weight.data.copy_(dequantize(q, dtype))
    if quantized.config.tie_word_embeddings:  # the head is its own layer there: the dense twin has none
        head = layers["lm_head"].quantized
        dense.embed_tokens.weight.data.copy_(dequantize_int8(head, dtype))
    return dense


@needs_kernels
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("mistral", False)])
def test_an_int8_model_computes_what_its_dequantized_weights_do(tiny_model_dir, arch, tied):
    """Logits of a prompt and decode steps, quantized (every layer and the head, tied or not) against
    the dense model holding the dequantized weights. A tied head is a quantized layer of its own, and
    lookups read its rows (the dense table is dropped): the twin's tied table is the dequantized head."""
    folder = tiny_model_dir(arch, tied)
    backend = get_attention_backend("cpu")
    method = get_quant_method(QuantSpec("int8"), KERNELS)
    model = load_model(folder, dtype="float32", backend=backend, ops=get_layer_ops("cpu"), linear_method=method)
    assert not hasattr(model.layers[0].self_attn.qkv_proj, "weight")  # the dense copy is gone
    assert model.weight_bytes() < load_model(folder, dtype="float32").weight_bytes()
    twin_backend = get_attention_backend("cpu")
    twin = dequantized_twin(folder, model, torch.float32, twin_backend)
    assert not any(n.startswith("embed_tokens") for n, _ in model.named_parameters()) or not tied
    ids = list(range(3, 3 + 19))
    ours = run_steps(model, backend, ids, 3, 2)
    theirs = run_steps(twin, twin_backend, ids, 3, 2)
    for a, b in zip(ours, theirs, strict=True):
        la, lb = model.compute_logits(a), twin.compute_logits(b)
        assert (la - lb).abs().max() / lb.abs().max() < 2e-3  # the activations' 16-bit fixed point


@needs_kernels
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_a_w8a8_model_computes_what_torchs_integer_gemm_does(tiny_model_dir, arch, tied):
    """W8A8 also quantizes the activations, so its reference is the same quantization through torch
    (per-row rounding in torch, `torch._int_mm`): the native kernels against it, layer after layer."""
    folder = tiny_model_dir(arch, tied)
    backend, twin_backend = get_attention_backend("cpu"), get_attention_backend("cpu")
    ops = get_layer_ops("cpu")
    model = load_model(
        folder, dtype="float32", backend=backend, ops=ops, linear_method=get_quant_method(QuantSpec("w8a8"), KERNELS)
    )
    twin = load_model(
        folder, dtype="float32", backend=twin_backend, ops=ops, linear_method=get_quant_method(QuantSpec("w8a8"), None)
    )
    ids = list(range(3, 3 + 19))
    for a, b in zip(run_steps(model, backend, ids, 3, 2), run_steps(twin, twin_backend, ids, 3, 2), strict=True):
        la, lb = model.compute_logits(a), twin.compute_logits(b)
        # one activation rounded the other way (a tie moved by float32 ordering) moves a logit by a grid step
        assert (la - lb).abs().max() / lb.abs().max() < 1e-2


@needs_kernels
@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_stack_chains_quantized_projections_to_the_bit(tiny_model_dir, name, dtype):
    folder = tiny_model_dir("qwen2")  # q/k/v biases through the quantized kernels too
    backend = get_attention_backend("cpu")
    method = get_quant_method(QuantSpec(name), KERNELS)
    model = load_model(folder, dtype=dtype, backend=backend, ops=get_layer_ops("cpu"), linear_method=method)
    assert FusedDecode.supports(model)
    prompt = list(range(5, 5 + 17))
    modules = run_steps(model, backend, prompt, 3, 3)
    model.fused_decode = FusedDecode(KERNELS, model)
    kinds = model.fused_decode.plan(torch.zeros(3, 128), backend.build_metadata([1] * 3, [9] * 3, [[0]] * 3, 16))
    assert kinds is not None and len(set(kinds)) == 1  # one quantized kernel for all four projections
    fused = run_steps(model, backend, prompt, 3, 3)
    for a, b in zip(modules, fused, strict=True):
        assert torch.equal(a, b)
    unchained = "int_mm" if name == "w8a8" else "dequant"  # a kernel the stack does not chain: the modules run
    method.plan = {shape: (unchained,) * 9 for shape in [(256, 128), (128, 128), (704, 128), (128, 352)]}
    assert model.fused_decode.plan(torch.zeros(3, 128), backend.build_metadata([1] * 3, [9] * 3, [[0]] * 3, 16)) is None


@needs_kernels
@pytest.mark.parametrize("name", METHODS)
def test_the_engine_serves_a_quantized_model(tiny_model_dir, name):
    folder = tiny_model_dir("llama", True)
    dense = LLM(str(folder), max_model_len=128, kv_cache_memory=64 * 24576)
    llm = LLM(str(folder), max_model_len=128, kv_cache_memory=64 * 24576, quantization=name)
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(prompts(4), params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert llm.stats().weight_bytes < dense.stats().weight_bytes
    assert llm.stats().kv_tokens == dense.stats().kv_tokens
    assert_no_leaks(llm)


def test_a_group_size_that_does_not_divide_names_the_layer(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj|layers\.0\.mlp\.down_proj"):
        LLM(str(folder), quantization="int8", quantization_group_size=64)  # the MLP's 352 inputs
    llm = LLM(str(folder), quantization="int8", quantization_group_size=64, quantization_group_fallback=True)
    down = llm.engine.core.worker.runner.model.layers[0].mlp.down_proj
    assert down.quantized.group == 32
    with pytest.raises(ValueError, match="quantization_group_size, quantization_head: apply to int8, int4 or w8a8"):
        LLM(str(folder), quantization_group_size=64)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_without_native_kernels_the_torch_paths_run(tiny_model_dir, name):
    """No native kernels (a CPU they do not build on): int8 dequantizes for torch's GEMM, int4 runs
    torch's int4 kernel; the same products as the dequantized weights. (W8A8 runs torch's integer
    GEMM there: the reference of the W8A8 test above.)"""
    folder = tiny_model_dir("mistral")
    backend = get_attention_backend("torch")
    method = get_quant_method(QuantSpec(name), None)
    model = load_model(folder, dtype="float32", backend=backend, linear_method=method)
    assert set(method.kernels(torch.float32)) == {"int8": {"dequant"}, "int4": {"int4pack", "dequant"}}[name]
    assert set(get_quant_method(QuantSpec("w8a8"), None).kernels(torch.float32)) == {"int_mm"}
    twin_backend = get_attention_backend("torch")
    twin = dequantized_twin(folder, model, torch.float32, twin_backend)
    ids = list(range(7, 7 + 13))
    ours = run_steps(model, backend, ids, 2, 2)
    theirs = run_steps(twin, twin_backend, ids, 2, 2)
    tol = {"int8": 1e-5, "int4": 3e-2}[name]  # int4: torch's kernel takes bfloat16 activations
    for a, b in zip(ours, theirs, strict=True):
        la, lb = model.compute_logits(a), twin.compute_logits(b)
        assert (la - lb).abs().max() / lb.abs().max() < tol


def test_eval_quant_reports_quality_and_memory(tiny_model_dir, tmp_path):
    """The report compares the two models' distributions position by position: int4 moves them more
    than int8 does, and both save weight bytes that the report turns into KV tokens."""
    from tokenmill.cli import main
    from tokenmill.eval.quant_eval import evaluate

    folder = tiny_model_dir("llama")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2 + 1\n" * 200, encoding="utf-8")
    reports = {q: evaluate(str(folder), QuantSpec(q), "float32", text, windows=2, length=64) for q in ("int8", "int4")}
    for r in reports.values():
        assert r.windows == 2 and r.predicted_tokens == 2 * 63
        assert r.weight_bytes_quantized < r.weight_bytes_unquantized and r.kv_tokens_freed > 0
        assert r.mean_kl_nats > 0 and 0 < r.top1_agreement <= 1
    assert reports["int4"].mean_kl_nats > reports["int8"].mean_kl_nats
    assert reports["int4"].weight_bytes_quantized < reports["int8"].weight_bytes_quantized
    out = tmp_path / "report.json"
    argv = ["eval-quant", str(folder), "--quantization", "int8", "--dtype", "float32", "--text", str(text)]
    assert main([*argv, "--windows", "1", "--window-len", "32", "--json", str(out)]) == 0
    assert '"top1_agreement"' in out.read_text()
    with pytest.raises(ValueError, match="fewer than one window of 4096"):
        evaluate(str(folder), QuantSpec("int8"), "float32", text, windows=1, length=4096)


def test_the_default_kv_budget_grows_by_the_bytes_quantized_weights_free(tiny_model_dir):
    from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY
    from tokenmill.runner.kv_cache import kv_bytes_per_block

    folder = str(tiny_model_dir("qwen2"))
    dense = LLM(folder, max_model_len=128)
    int4 = LLM(folder, max_model_len=128, quantization="int4")
    model = int4.engine.core.worker.runner.model
    freed = model.dense_weight_bytes() - model.weight_bytes()
    assert model.dense_weight_bytes() == dense.engine.core.worker.runner.model.weight_bytes() and freed > 0
    worker = int4.engine.core.worker
    per_block = kv_bytes_per_block(worker.backend, model.config, worker.block_size, worker.kv_dtype)
    assert worker.num_blocks == (DEFAULT_CPU_KV_CACHE_MEMORY + freed) // per_block
    assert int4.stats().kv_tokens > dense.stats().kv_tokens


@pytest.mark.parametrize("fmt", ["int8", "int8g32", "int4", "int4pack"])
def test_rows_of_a_quantized_head_are_its_dequantized_rows(fmt):
    """What a tied embedding table reads once only its quantized head is kept."""
    from tokenmill.quant.quantize import int4_rows, int4pack_rows, int8_rows

    w = weights(128, 96)
    ids = torch.tensor([0, 5, 63, 64, 127, 5])
    if fmt.startswith("int8"):
        q = quantize_int8(w, 32 if fmt == "int8g32" else 96)
        assert torch.equal(int8_rows(q, ids), dequantize_int8(q, torch.float32)[ids])
    elif fmt == "int4":
        q4 = quantize_int4(w, 32)
        assert torch.equal(int4_rows(q4, ids), dequantize_int4(q4, torch.float32)[ids])
    else:
        qp = quantize_int4pack(w, 32)
        assert torch.equal(int4pack_rows(qp, ids), dequantize_int4pack(qp, torch.float32)[ids])


@needs_kernels
@pytest.mark.parametrize("name", METHODS)
def test_no_rows_give_an_empty_product(name):
    """A step that samples nothing hands the output projection no rows: every kernel returns [0, N]."""
    method = get_quant_method(QuantSpec(name), KERNELS)
    w = method.quantize(weights(64, 128), 128 if name != "int4" else 32)
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in method.kernels(dtype).values():
            assert kernel(w, torch.empty(0, 128, dtype=dtype), None).shape == (0, 64)
    dense = torch.empty(0, 64)
    KERNELS.ops.linear(dense, torch.empty(0, 128), weights(64, 128), None)


@needs_kernels
def test_fastest_dtype_times_the_quantized_layers(tiny_model_dir):
    """`--dtype fastest` with a quantization times each candidate's quantized kernels (not dense ones
    the model no longer has) and serves the pick."""
    llm = LLM(
        str(tiny_model_dir("llama", True)),
        max_model_len=64,
        kv_cache_memory=16 * 24576,
        quantization="int8",
        dtype="fastest",
    )
    assert llm.engine.core.worker.dtype in (torch.float32, torch.bfloat16)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(llm)


@needs_kernels
def test_the_output_projection_can_stay_int8_under_int4_layers(tiny_model_dir):
    """`quantization_head="int8"`: the layers in int4, the (tied) head in int8, tuned apart; its logits
    are the int4 model's with the head's error cut (closer to the dense model's than all-int4)."""
    folder = str(tiny_model_dir("llama", True))
    common = {"max_model_len": 64, "kv_cache_memory": 16 * 24576, "quantization": "int4"}
    mixed = LLM(folder, quantization_head="int8", **common)
    model = mixed.engine.core.worker.runner.model
    layers = "int4_blocks" if in_blocks(QuantSettings("int4")) else "int4"  # (Q4_1 blocks on Zen 4's kind)
    assert model.lm_head.linear_method.name == "int8" and model.layers[0].mlp.down_proj.linear_method.name == layers
    assert [m.name for m in model.quantized_methods()] == [layers, "int8"]
    out = mixed.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(mixed)
    with pytest.raises(ValueError, match="quantization_head"):
        LLM(folder, quantization_head="int8")
