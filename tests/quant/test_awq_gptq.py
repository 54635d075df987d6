"""AWQ and GPTQ checkpoints loaded as they are stored (quant/awq_gptq.py).

Each test folder is a tiny random model whose projections are quantized here and packed by this
file's own packers, written from the formats' descriptions (AWQ: along the output, nibble i of a
word holding column ORDER[i] of its eight; GPTQ: along the input, nibble i of row r holding k = 8 r
+ i, zero points stored minus one in v1), not by the loader's code. The reference is the same model
with the dequantized weights (q - z) * s written dense. transformers loads neither format on a CPU
without their kernel packages (autoawq, gptqmodel), so the reference is that dense folder."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.test_engine import assert_no_leaks
from tests.helpers import (
    PagedRunner,
    assert_logits_close,
    assert_same_up_to_near_tie,
    top_logprobs,
    write_quantized_copies,
)
from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import LinearBase
from tokenmill.models.config import ModelLoadError
from tokenmill.models.loader import load_model
from tokenmill.quant.quantize import Int4Weight, Int8Weight, dequantize_int4

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
IDS = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(2))


def quantize(
    w: torch.Tensor, group: int, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [K, N] in 0..15, zeros [K / g, N] in 0..15, scales [K / g, N] float16; `order`:
    GPTQ's activation order (group j holds inputs order[j * g : (j + 1) * g]; q stays in input order)."""
    n, k = w.shape
    if order is not None:
        q, zeros, scales = quantize(w[:, order], group)
        return q[torch.argsort(order)], zeros, scales
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    return q.t().int(), zero.t().int(), scale.t().contiguous()


def dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """[K, N] values, input k in group g_idx[k] -> the dense weight [N, K]."""
    z, s = zeros[g_idx.long()].float(), scales[g_idx.long()].float()
    return ((q.float() - z) * s).t().contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
    r, c = values.shape
    packed = torch.zeros(r, c // 8, dtype=torch.int64)
    for word in range(c // 8):
        for i, col in enumerate(AWQ_ORDER):
            packed[:, word] |= values[:, 8 * word + col].long() << (4 * i)
    return packed.to(torch.int32)  # (bits past 31 wrap, as the int32 files hold them)


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:  # [K, N] -> [K / 8, N]
    k, n = values.shape
    packed = torch.zeros(k // 8, n, dtype=torch.int64)
    for row in range(k // 8):
        for i in range(8):
            packed[row] |= values[8 * row + i].long() << (4 * i)
    return packed.to(torch.int32)


def pack_gptq_columns(values: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
    r, c = values.shape
    packed = torch.zeros(r, c // 8, dtype=torch.int64)
    for word in range(c // 8):
        for i in range(8):
            packed[:, word] |= values[:, 8 * word + i].long() << (4 * i)
    return packed.to(torch.int32)


def write_quantized(
    source: Path, out: Path, method: str, group: int = 32, v2: bool = False, desc_act: bool = False
) -> tuple[Path, Path]:
    """(quantized folder, dense reference folder) of the model in `source`; `desc_act`: GPTQ's
    activation order, one random order per layer input (q, k and v share theirs, gate and up theirs)."""

    def pack(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        order = None
        if desc_act:  # the same order for the projections that read one input
            parent, leaf = prefix.rsplit(".", 1)
            family = parent + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf)
            order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(zlib.crc32(family.encode())))
        q, zeros, scales = quantize(w, group, order)
        g_idx = torch.arange(w.shape[1]) // group
        if order is not None:
            g_idx = torch.empty_like(g_idx).scatter_(0, order, torch.arange(w.shape[1]) // group)
        if method == "awq":
            tensors = {"qweight": pack_awq(q), "qzeros": pack_awq(zeros)}
        else:
            stored_zeros = zeros if v2 else zeros - 1  # v1 stores zero - 1
            tensors = {"qweight": pack_gptq_rows(q), "qzeros": pack_gptq_columns(stored_zeros & 15)}
            tensors["g_idx"] = g_idx.to(torch.int32)
        return tensors | {"scales": scales}, dequantized(q, zeros, scales, g_idx)

    config = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": False}
        | ({"checkpoint_format": "gptq_v2"} if v2 else {})
    )
    ref = out.with_name(out.name + "-dense")
    write_quantized_copies(source, out, ref, pack, config)  # (one file, or shards: written back as one file)
    return out, ref


def logits(model) -> torch.Tensor:
    return PagedRunner(model, num_blocks=8, block_size=16, block_order=[4, 1, 6, 3, 0, 7, 2, 5]).step({0: IDS})[0]


@pytest.mark.parametrize(
    ("arch", "method", "v2"),
    [("llama", "awq", False), ("qwen2", "awq", False), ("llama", "gptq", False), ("qwen2", "gptq", True)],
)
def test_a_quantized_checkpoint_computes_what_its_dequantized_weights_do(tiny_model_dir, tmp_path, arch, method, v2):
    folder, ref = write_quantized(tiny_model_dir(arch), tmp_path / method, method, v2=v2)
    model = load_model(folder, dtype="float32")
    dense = load_model(ref, dtype="float32")
    ref_layers = dict(dense.named_modules())
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase) and name != "lm_head":
            assert isinstance(layer.quantized, Int4Weight) and layer.quantized.group == 32, name
            assert not hasattr(layer, "qweight"), name  # the packed tensors go once unpacked
            # the weights as stored: (q - z) * s, to float rounding
            ours, theirs = dequantize_int4(layer.quantized, torch.float32), ref_layers[name].weight
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), name
    assert_logits_close(logits(model), logits(dense), rel=1e-5)


def test_the_engine_serves_an_awq_folder(tiny_model_dir, tmp_path):
    folder, ref = write_quantized(tiny_model_dir("llama"), tmp_path / "awq", "awq")
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5)
    kwargs = {"dtype": "float32", "kv_cache_memory": 8 * 2**20, "max_num_seqs": 4}
    llm, dense = LLM(str(folder), **kwargs), LLM(str(ref), **kwargs)
    assert llm.stats().weight_bytes < dense.stats().weight_bytes
    assert llm.engine.core.worker.runner.model.fused_decode is not None  # decode steps: one native call
    prompts = [[5, 9, 33, 100], [7, 7, 7]]
    for a, b in zip(
        llm.generate(prompts, params, use_tqdm=False), dense.generate(prompts, params, use_tqdm=False), strict=True
    ):
        x, y = a.outputs[0], b.outputs[0]
        # (the int4 kernel's int8 activations: a tie as wide as the GGUF int4 tests')
        assert_same_up_to_near_tie(
            x.token_ids, top_logprobs(x.logprobs), y.token_ids, top_logprobs(y.logprobs), tie_nats=0.3
        )
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="this checkpoint is AWQ-quantized; it loads as stored"):
        LLM(str(folder), quantization="none", **kwargs)
    with pytest.raises(ValueError, match="AWQ-quantized already; leave quantization auto, not int8"):
        LLM(str(folder), quantization="int8", **kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, r"field 'quantization_config\.bits' is 8; tokenmill loads 4-bit awq"),
        ({"group_size": 48}, r"field 'quantization_config\.group_size' is 48"),
        ({"version": "gemv"}, r"field 'quantization_config\.version' is 'gemv'"),
        ({"quant_method": "fp8"}, r"field 'quantization_config\.quant_method' is 'fp8'; tokenmill loads awq, gptq"),
    ],
)
def test_an_unsupported_quantization_config_names_the_field(tiny_model_dir, tmp_path, change, message):
    folder, _ = write_quantized(tiny_model_dir("llama"), tmp_path / "awq", "awq")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] |= change
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder)


def test_inconsistent_tensors_are_refused_by_name(tiny_model_dir, tmp_path):
    folder, _ = write_quantized(tiny_model_dir("llama"), tmp_path / "gptq", "gptq")
    tensors = load_file(str(folder / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.scales"]
    save_file(missing, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.scales' missing"):
        load_model(folder)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.k_proj.qweight"] = bad["model.layers.0.self_attn.k_proj.qweight"][:, :32].contiguous()
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.qweight' has shape \[16, 32\]"
    ):
        load_model(folder)
    permuted = dict(tensors)
    permuted["model.layers.0.mlp.down_proj.g_idx"] = permuted["model.layers.0.mlp.down_proj.g_idx"].flip(0)
    save_file(permuted, str(folder / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"down_proj\.g_idx'.*g_idx is not k // 32, and quantization_config\.desc_act is false"
    ):
        load_model(folder)


def test_an_activation_order_gptq_checkpoint_computes_what_its_dequantized_weights_do(tiny_model_dir, tmp_path):
    """desc_act: each layer input's order (shared by q, k, v, and by gate, up) applied once at load, so
    the int4 kernel reads contiguous groups; the engine runs it (without the fused decode, which does
    not permute inputs) and a shard whose g_idx differs from its layer's is refused."""
    folder, ref = write_quantized(tiny_model_dir("llama"), tmp_path / "gptq", "gptq", desc_act=True)
    model, dense = load_model(folder, dtype="float32"), load_model(ref, dtype="float32")
    assert_logits_close(logits(model), logits(dense), rel=1e-5)
    kwargs = {"dtype": "float32", "kv_cache_memory": 8 * 2**20, "max_num_seqs": 2}
    llm, on_dense = LLM(str(folder), **kwargs), LLM(str(ref), **kwargs)
    assert llm.engine.core.worker.runner.model.fused_decode is None
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    a, b = (
        llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0].outputs[0],
        on_dense.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0].outputs[0],
    )
    assert_same_up_to_near_tie(
        a.token_ids, top_logprobs(a.logprobs), b.token_ids, top_logprobs(b.logprobs), tie_nats=0.3
    )
    assert_no_leaks(llm)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.g_idx"] = (
        tensors["model.layers.0.self_attn.k_proj.g_idx"].flip(0).contiguous()
    )
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"self_attn\.[qkv]_proj\.g_idx'.*g_idx differs from the other shards'"):
        load_model(folder)


def test_an_8_bit_gptq_checkpoint_loads_into_int8(tiny_model_dir, tmp_path):
    """GPTQ 8-bit, symmetric (every zero point 128, stored as 127 in v1): four values a word along the
    input, zero points four a word along the output; loaded as int8 (q - 128) with its scales."""
    folder, ref = tmp_path / "gptq8", tmp_path / "gptq8-dense"

    def pack(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        g = w.float().reshape(n, k // 32, 32)
        scale = (g.abs().amax(-1) / 127).half()  # [N, K / 32]
        q = (torch.round(g / scale.float()[..., None]) + 128).clamp(1, 255).reshape(n, k).t().long()  # [K, N]
        words = torch.zeros(k // 4, n, dtype=torch.int64)
        for i in range(4):
            words |= q[i::4] << (8 * i)
        zeros = torch.full((k // 32, n), 127, dtype=torch.int64)  # v1: zero - 1
        zwords = torch.zeros(k // 32, n // 4, dtype=torch.int64)
        for i in range(4):
            zwords |= zeros[:, i::4] << (8 * i)
        tensors = {
            "qweight": words.to(torch.int32),
            "qzeros": zwords.to(torch.int32),
            "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // 32).to(torch.int32),
        }
        return tensors, ((q.float() - 128) * scale.float().t().repeat_interleave(32, 0)).t()

    config = {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True}
    write_quantized_copies(tiny_model_dir("llama"), folder, ref, pack, config)
    model = load_model(folder, dtype="float32")
    assert all(
        isinstance(m.quantized, Int8Weight)
        for n, m in model.named_modules()
        if isinstance(m, LinearBase) and n != "lm_head"
    )
    assert_logits_close(logits(model), logits(load_model(ref, dtype="float32")), rel=1e-5)
