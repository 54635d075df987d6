"""compressed-tensors' pack-quantized checkpoints (llm-compressor's W4A16 / W8A16), loaded into the
int4 / int8 formats without dequantizing; read with the `compressed-tensors` library's own unpacking.

Per layer (config.json's `quantization_config`, parsed into `CheckpointQuantization`):
`weight_packed` int32 [N, K * bits / 32] (the values, signed, packed densely along the input),
`weight_scale` [N, K / g] (one per output channel: [N, 1]), `weight_zero_point` (asymmetric only:
int32 [N * bits / 32, K / g], signed zero points packed along the output), `weight_shape` [2].
W = (q - z) * s with q, z signed. int4 becomes `Int4Weight`: q + 8 (0..15), scale s and minimum
-(z + 8) * s in float32 (exact: the checkpoints' scales are bfloat16 or float32, which float16 would
round); symmetric int8 becomes `Int8Weight` (q, s). The output shards of a
fused layer are placed along the output dimension (the zero points' packed rows included: shard
sizes a multiple of 8), and unpacked once every shard is in.
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
    WeightShapeError,
    register_bias,
    set_weight_loader,
)
from tokenmill.quant.quantize import MIN_GROUP, QuantSpec, int8_weight, pack_int4


class ShapeCheck:
    """`weight_shape`'s loader: each shard's must be (its rows, the input width); nothing is kept."""

    def __init__(self, shards: dict[ShardId, Shard], input_size: int) -> None:
        self.shards, self.input_size = shards, input_size

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        shard = self.shards[shard_id]
        got = tuple(int(v) for v in loaded.tolist())
        if got != (shard.size, self.input_size):
            raise WeightShapeError(got, (shard.size, self.input_size), shard_id)


def _create(layer: Layer, quant: CheckpointQuantization, input_size: int, bias: bool, dtype: torch.dtype) -> None:
    n, k, bits = layer.output_size, input_size, quant.bits
    group = quant.group_size or k
    if k % group or (k * bits) % 32:
        raise ValueError(f"quantization_config group_size: {group} does not divide the input width {k}")
    per_word = 32 // bits
    params: dict[str, tuple[tuple[int, ...], torch.dtype, object]] = {
        "weight_packed": ((n, k * bits // 32), torch.int32, ShardLoader(layer.shards)),
        "weight_scale": ((n, k // group), torch.float32, ShardLoader(layer.shards)),
        "weight_shape": ((2,), torch.int64, ShapeCheck(layer.shards, k)),
    }
    if not quant.symmetric:
        for sid, s in layer.shards.items():
            if s.start % per_word or s.size % per_word:
                raise ValueError(f"output shard {sid!r} ({s.size} rows) is not a multiple of {per_word}")
        packed = {sid: Shard(s.start // per_word, s.size // per_word) for sid, s in layer.shards.items()}
        params["weight_zero_point"] = ((n // per_word, k // group), torch.int32, ShardLoader(packed))
    for name, (shape, kind, loader) in params.items():
        param = nn.Parameter(torch.empty(shape, dtype=kind), requires_grad=False)
        layer.register_parameter(name, set_weight_loader(param, loader))  # type: ignore[arg-type]
    if bias:
        register_bias(layer, dtype)


def _unpacked(layer: Layer, quant: CheckpointQuantization) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q [N, K] signed, scales [N, G] float32, zero points [N, G] signed, group) of the loaded layer."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = layer.output_size, layer.input_size
    group = quant.group_size or k
    scales = layer.weight_scale.data.float()  # type: ignore[union-attr]
    q = unpack_from_int32(layer.weight_packed.data, quant.bits, torch.Size((n, k)))  # type: ignore[union-attr]
    if quant.symmetric:
        zeros = torch.zeros_like(scales, dtype=torch.int8)
    else:
        zp = layer.weight_zero_point.data  # type: ignore[union-attr]
        zeros = unpack_from_int32(zp, quant.bits, torch.Size((n, k // group)), packed_dim=0)
    for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
        layer._parameters.pop(name, None)
    return q, scales, zeros, group


class StoredCompressed(QuantizedLinearMethod):
    """What the compressed-tensors methods share: the checkpoint's tensors as the layer's parameters."""

    def __init__(self, quant: CheckpointQuantization, kernels: CpuKernels | None) -> None:
        super().__init__(QuantSpec(self.name, quant.group_size), kernels, prequantized=True)
        self.quant = quant

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        _create(layer, self.quant, input_size, bias, dtype)


class CompressedInt4Method(StoredCompressed, Int4LinearMethod):
    """compressed-tensors' pack-quantized int4 layers, as stored."""

    def process_weights_after_loading(self, layer: Layer) -> None:
        q, scales, zeros, group = _unpacked(layer, self.quant)
        if group < MIN_GROUP or group & (group - 1):
            raise ValueError(f"quantization_config: one scale per channel of width {group} (not a power of two)")
        mins = -(zeros.float() + 8) * scales  # W = (q - z) * s = (q + 8) * s - (z + 8) * s
        layer.quantized = pack_int4(q.int() + 8, scales, mins, group)  # type: ignore[assignment]


class CompressedInt8Method(StoredCompressed, Int8LinearMethod):
    """compressed-tensors' pack-quantized symmetric int8 layers, as stored."""

    def process_weights_after_loading(self, layer: Layer) -> None:
        q, scales, _, group = _unpacked(layer, self.quant)
        layer.quantized = int8_weight(q.to(torch.int8), scales, group)  # type: ignore[assignment]


def compressed_method(quant: CheckpointQuantization, kernels: CpuKernels | None) -> QuantizedLinearMethod:
    return CompressedInt4Method(quant, kernels) if quant.bits == 4 else CompressedInt8Method(quant, kernels)
