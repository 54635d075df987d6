"""AWQ and GPTQ checkpoints' layers (4-bit; GPTQ's symmetric 8-bit too), loaded into tokenmill's int4 /
int8 formats without dequantizing.

Owns the two formats' tensors and packings (config.json's `quantization_config`, parsed into
`CheckpointQuantization`, quant/checkpoint.py, by models/config.py) and the linear methods that
take them:
- AWQ (GEMM version): `qweight` int32 [K, N / 8], eight 4-bit values a word packed along the output
  dimension in the order [0, 2, 4, 6, 1, 3, 5, 7] (word nibble i holds output column 8 j + ORDER[i]);
  `qzeros` int32 [K / g, N / 8] packed alike; `scales` [K / g, N]. W[n, k] = (q - z) * s.
- GPTQ: `qweight` int32 [K / 8, N], packed along the input dimension in order (nibble i of row r:
  k = 8 r + i); `qzeros` int32 [K / g, N / 8] packed along the output in order; `scales` [K / g, N];
  `g_idx` [K] (each input's group: k // g, or for `desc_act` files a permutation of those groups: the
  input dimension is then permuted once at load so the groups are contiguous, and each product gathers
  its inputs in that order). v1 files store zero - 1 (`checkpoint_format` gptq_v2: the zero).
Both become `Int4Weight`: q as stored, scale s (float16, as stored), min = -z * s in float32 (exact:
float16 would round it, which moved a tiny model's logits by 0.3% of their scale). The tensors load
into parameters named after the checkpoint's suffixes (the model maps `q_proj.qweight` to
`qkv_proj.qweight`, shard "q"), placed along their output dimension, and are unpacked once every
shard is in (`process_weights_after_loading`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.cpu_build import CpuKernels
from tokenmill.quant.checkpoint import CheckpointQuantization
from tokenmill.quant.int_methods import Int4LinearMethod, Int8LinearMethod, QuantizedLinearMethod
from tokenmill.quant.method import (
    Layer,
    Shard,
    ShardId,
    ShardLoader,
    WeightLoadError,
    WeightShapeError,
    register_bias,
    set_weight_loader,
)
from tokenmill.quant.quantize import MIN_GROUP, QuantSpec, int8_weight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds output column ORDER[i] of its eight


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...], bits: int = 4) -> torch.Tensor:
    """int32 [R, C / P] -> [R, C] unsigned (P = 32 / bits values a word): value i of word j is column
    P j + order[i]."""
    r, words = packed.shape
    per = 32 // bits
    out = torch.empty(r, words, per, dtype=torch.int32)
    for i, col in enumerate(order):
        out[:, :, col] = (packed >> (bits * i)) & ((1 << bits) - 1)
    return out.reshape(r, words * per)


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R / P, C] -> [R, C] unsigned: value i of row r is row P r + i."""
    words, c = packed.shape
    per = 32 // bits
    values = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    return torch.stack(values, dim=1).reshape(words * per, c)


def _packed_shards(shards: dict[ShardId, Shard], by: int) -> dict[ShardId, Shard]:
    """A layer's output shards measured in packed words (`by` values a word)."""
    for sid, s in shards.items():
        if s.start % by or s.size % by:
            raise ValueError(f"output shard {sid!r} ({s.size} rows) is not a multiple of {by}: it cannot be packed")
    return {sid: Shard(s.start // by, s.size // by) for sid, s in shards.items()}


def _create(layer: Layer, quant: CheckpointQuantization, input_size: int, bias: bool, dtype: torch.dtype) -> None:
    """The checkpoint's tensors as the layer's parameters, each placed along its output dimension."""
    n, k, per = layer.output_size, input_size, 32 // quant.bits
    group = quant.group_size or k
    if k % group or k % per:
        raise ValueError(f"quantization_config.group_size: {group} does not divide the input width {k}")
    awq = quant.method == "awq"
    by_word = _packed_shards(layer.shards, per)
    params = {  # name -> (shape, dtype, shards along dim 1)
        "qweight": ((k, n // per) if awq else (k // per, n), torch.int32, by_word if awq else layer.shards),
        "qzeros": ((k // group, n // per), torch.int32, by_word),
        "scales": ((k // group, n), torch.float16, layer.shards),
    }
    if not awq:
        params["g_idx"] = ((k,), torch.int32, {})
    for name, (shape, kind, shards) in params.items():
        param = nn.Parameter(torch.empty(shape, dtype=kind), requires_grad=False)
        loader = ShardLoader(shards, dim=1) if shards else GroupIndexLoader(group, quant.desc_act)
        layer.register_parameter(name, set_weight_loader(param, loader))
    if bias:
        register_bias(layer, dtype)


def _unpack(layer: Layer, quant: CheckpointQuantization) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q [K, N] unsigned, zero points [K / g, N], scales [K / g, N], group) of the loaded layer, its
    inputs in the kernel's order (GPTQ's activation order applied: the `input_order` buffer); the
    packed parameters dropped."""
    k, bits = layer.input_size, quant.bits
    group = quant.group_size or k
    if group < MIN_GROUP or group & (group - 1):
        raise ValueError(f"quantization_config.group_size: {group} (the input width) is not a power of two")
    qweight, qzeros = layer.qweight.data, layer.qzeros.data  # type: ignore[union-attr]
    scales = layer.scales.data  # type: ignore[union-attr]
    if quant.method == "awq":
        q = unpack_columns(qweight, AWQ_ORDER)  # [K, N]
        zeros = unpack_columns(qzeros, AWQ_ORDER)  # [K / g, N]
    else:
        q = unpack_rows(qweight, bits)  # [K, N]
        zeros = unpack_columns(qzeros, tuple(range(32 // bits)), bits) + (0 if quant.gptq_v2 else 1)
        g_idx = getattr(layer.g_idx, "g_idx_seen", None)
        order = None if g_idx is None else torch.argsort(g_idx, stable=True)  # kernel input j = checkpoint's order[j]
        if order is not None and not torch.equal(order, torch.arange(k)):  # activation order: groups made contiguous
            q = q[order]
            layer.register_buffer("input_order", order, persistent=False)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        layer._parameters.pop(name, None)
    return q, zeros, scales, group


class StoredLayers(QuantizedLinearMethod):
    """What the AWQ / GPTQ methods share: the checkpoint's tensors as the layer's parameters, and
    products taking the inputs in the kernel's order (a layer's `input_order` buffer, GPTQ's
    activation order; the fused decode, which does not permute inputs, skips such models)."""

    def __init__(self, quant: CheckpointQuantization, kernels: CpuKernels | None) -> None:
        super().__init__(QuantSpec(self.name, quant.group_size), kernels, prequantized=True)
        self.quant = quant

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        _create(layer, self.quant, input_size, bias, dtype)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        order = layer._buffers.get("input_order")
        return super().apply(layer, x if order is None else x.index_select(-1, order), bias)


class CheckpointInt4Method(StoredLayers, Int4LinearMethod):
    """AWQ's and GPTQ's 4-bit layers: int4, W = q * s - z * s (the minimum float32: exact)."""

    def process_weights_after_loading(self, layer: Layer) -> None:
        q, zeros, scales, group = _unpack(layer, self.quant)
        mins = -zeros.float() * scales.float()
        layer.quantized = pack_int4(q.t(), scales.t().contiguous(), mins.t().contiguous(), group)  # type: ignore[assignment]


class CheckpointInt8Method(StoredLayers, Int8LinearMethod):
    """GPTQ's 8-bit layers: symmetric ones (every zero point 128), as int8 q - 128."""

    def process_weights_after_loading(self, layer: Layer) -> None:
        q, zeros, scales, group = _unpack(layer, self.quant)
        if not bool((zeros == 128).all()):
            raise ValueError("qzeros: 8-bit zero points other than 128 (asymmetric int8) are not supported")
        q8 = (q - 128).to(torch.int8).t().contiguous()  # [N, K]
        layer.quantized = int8_weight(q8, scales.float().t().contiguous(), group)  # type: ignore[assignment]


class GroupIndexLoader:
    """GPTQ's `g_idx` loader: each input's group. Contiguous groups (k // group) need nothing; an
    activation-order file's (a permutation of them) must be the same for every shard of a fused layer
    (they share one input, so GPTQ orders them alike), kept for `process_weights_after_loading`."""

    def __init__(self, group: int, desc_act: bool) -> None:
        self.group, self.desc_act = group, desc_act

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise WeightShapeError(tuple(loaded.shape), tuple(param.shape), shard_id)
        g_idx = loaded.to(torch.int64)
        k = param.shape[0]
        in_order = torch.equal(g_idx, torch.arange(k) // self.group)
        if not self.desc_act and not in_order:
            raise WeightLoadError(f"g_idx is not k // {self.group}, and quantization_config.desc_act is false")
        counts = torch.bincount(g_idx, minlength=k // self.group) if g_idx.min() >= 0 else None
        if counts is None or counts.numel() != k // self.group or not bool((counts == self.group).all()):
            raise WeightLoadError(f"g_idx does not put {self.group} inputs in each of {k // self.group} groups")
        seen = getattr(param, "g_idx_seen", None)
        if seen is not None and not torch.equal(seen, g_idx):
            raise WeightLoadError(f"shard {shard_id!r}: g_idx differs from the other shards' (one input, one order)")
        param.g_idx_seen = g_idx  # type: ignore[attr-defined]


def checkpoint_method(quant: CheckpointQuantization, kernels: CpuKernels | None) -> QuantizedLinearMethod:
    """The method that loads a checkpoint's AWQ, GPTQ or compressed-tensors layers as they are."""
    if quant.method == "compressed-tensors":
        from tokenmill.quant.compressed import compressed_method

        return compressed_method(quant, kernels)
    return CheckpointInt4Method(quant, kernels) if quant.bits == 4 else CheckpointInt8Method(quant, kernels)
