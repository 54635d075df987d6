"""Every decoder layer as one native call, for steps without prompt chunks on the CPU kernels.

`FusedDecode` runs the model's `DecoderLayer`s through `kernels/csrc/decode_layer.cpp`, which chains
the same native ops the layers' modules call one by one (norms, projections, rotary, KV write, paged
attention, SwiGLU) in the same order, so its outputs equal the modules' to the bit; what it removes
is the Python between them (~20 torch calls and ~10 module calls a layer, then the call a layer
itself: see `benchmarks/fused_decode.py`). It applies where every piece is the
native one (the `cpu` attention backend and layer ops; dense, int8, W8A8 or int4 weights), to steps
whose every sequence the paged kernel attends (no prompt chunk for SDPA) and without padding rows;
each projection keeps its linear method's choice of kernel for the step's row count (a quantized
layer's dequantize-then-GEMM or torch integer GEMM is not chained: such a step runs the modules).
Anything else runs the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from tokenmill.kernels.cpu_build import CpuKernels
from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.layers.backends.cpu_paged import CpuMetadata, CpuPagedBackend
from tokenmill.layers.cpu_linear import CpuLinearMethod
from tokenmill.layers.cpu_ops import CpuOps
from tokenmill.layers.linear import LinearBase, UnquantizedLinearMethod
from tokenmill.layers.quant_linear import Int4LinearMethod, Int8LinearMethod, QuantizedLinearMethod, W8A8LinearMethod
from tokenmill.layers.quantize import Int4PackWeight, Int4Weight, Int8Weight

if TYPE_CHECKING:
    from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM


# the kernel names of each method -> decode_layer.cpp's projection kinds
TORCH, NATIVE, INT8, W8A8, INT4PACK, INT4, INT8_TILED, W8A8_TILED, W8A8_AMX, INT8_AMX, INT4_AMX = range(11)
# (by the method's name: a checkpoint's int4 / int8 layers, AWQ, GPTQ or compressed-tensors, are the same
# formats once loaded)
QUANTIZED_KINDS = {
    ("int8", "native"): INT8,
    ("w8a8", "native"): W8A8,
    ("int4", "int4pack"): INT4PACK,
    ("int4", "native"): INT4,
    ("int8", "tiled"): INT8_TILED,
    ("w8a8", "tiled"): W8A8_TILED,
    ("w8a8", "amx"): W8A8_AMX,
    ("int8", "amx"): INT8_AMX,
    ("int4", "amx"): INT4_AMX,
}
FUSABLE_METHODS = (CpuLinearMethod, UnquantizedLinearMethod, Int8LinearMethod, W8A8LinearMethod, Int4LinearMethod)


class FusedDecode:
    """The decoder layers of one model as one native call a decode step (`decode_stack`): each layer's
    tensors gathered once here, so a step passes only what changes (hidden states, rotary inputs,
    caches, attention metadata). Build it once the weights are final: it keeps references to them."""

    def __init__(self, kernels: CpuKernels, model: LlamaForCausalLM) -> None:
        self._op = kernels.ops.decode_stack.default
        layers = cast("list[DecoderLayer]", list(model.layers))
        self._norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._first = _projections(layers[0])  # every layer's kernel choices are the first's
        projections = [p for layer in layers for p in _projections(layer)]
        self._weights, self._scales, self._wsums = [], [], []
        for p in projections:
            weight, scales, wsums = _tensors(p)
            self._weights.append(weight)
            self._scales.append(scales)
            self._wsums.append(wsums)
        self._biases = [p.bias for p in projections]
        self._groups = [_group(p) for p in self._first]
        self._out_features = [p.output_size for p in self._first]
        self._windows = [layer.self_attn.sliding_window for layer in layers]
        attn = layers[0].self_attn
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self._eps = layers[0].input_layernorm.eps
        self._scale = attn.scale
        self._caches: tuple[list[KVCache], list[torch.Tensor], list[torch.Tensor | None]] | None = None

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether `model` runs entirely on the pieces the fused layers chain."""
        layers = cast("list[DecoderLayer]", list(model.layers))
        if not layers or model.config.qk_norm or not isinstance(model.ops, CpuOps):
            return False
        attn = layers[0].self_attn
        if not isinstance(attn.backend, CpuPagedBackend):
            return False
        # (a projection that gathers its inputs in another order first, GPTQ's activation order: the modules)
        return all(isinstance(p.linear_method, FUSABLE_METHODS) for p in _projections(layers[0])) and not any(
            "input_order" in p._buffers for layer in layers for p in _projections(layer)
        )

    def plan(self, x: torch.Tensor, metadata: AttentionMetadata) -> list[int] | None:
        """For a step: each projection's kernel (a decode_layer.cpp kind) at the step's row count, the
        same for every layer; None when the step has a prompt chunk or padding, or a projection's
        kernel at this row count is not one the native layers chain (the modules run it)."""
        md = metadata
        if not isinstance(md, CpuMetadata) or md.prefills or md.num_actual_tokens != x.shape[0]:
            return None
        rows = x.shape[0]
        kinds = [_kind(p, rows) for p in self._first]
        return None if None in kinds else cast(list[int], kinds)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]: the embeddings
        rope: object,  # CpuOps.rotary_inputs: positions, cos, sin
        caches: list[KVCache],  # one per layer
        metadata: CpuMetadata,
        kinds: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the last layer's (MLP output, residual), as DecoderLayer.forward
        positions, cos, sin = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], rope)
        md = metadata
        heads, kv_heads, head_dim = self._heads
        if self._caches is None or self._caches[0] is not caches:  # the same list every step: flattened once
            self._caches = (
                caches,
                [t for c in caches for t in (c.k, c.v)],
                [t for c in caches for t in (c.k_scale, c.v_scale)],
            )
        _, cache_tensors, cache_scales = self._caches
        out, res = self._op(
            x, self._norms, self._weights, self._biases, self._scales, self._wsums, cache_tensors, cache_scales,
            self._eps, kinds, self._groups, self._out_features,
            heads, kv_heads, head_dim, positions, cos, sin, md.slot_mapping, md.block_tables, md.seq_lens,
            md.query_starts, md.query_lens, md.block_size, self._scale, self._windows,
        )  # fmt: skip
        return out, res


def _projections(layer: DecoderLayer) -> tuple[LinearBase, LinearBase, LinearBase, LinearBase]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _tensors(p: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, scales, wsums) as decode_layer.cpp takes them for this projection's method."""
    quantized = getattr(p, "quantized", None)
    if isinstance(quantized, Int8Weight):
        scales = quantized.scales.view(-1) if isinstance(p.linear_method, W8A8LinearMethod) else quantized.scales
        return quantized.q, scales, quantized.wsums
    if isinstance(quantized, Int4PackWeight):
        return quantized.packed, quantized.scales_zeros, None
    if isinstance(quantized, Int4Weight):  # its mins where the W8A8 kernel takes the row sums
        return quantized.packed, quantized.scales, quantized.mins
    return cast(torch.Tensor, p.weight), None, None


def _group(p: LinearBase) -> int:
    quantized = getattr(p, "quantized", None)
    return cast(int, quantized.group) if quantized is not None else p.input_size


def _kind(projection: LinearBase, rows: int) -> int | None:
    method = projection.linear_method
    if isinstance(method, QuantizedLinearMethod):
        kernel = method.kernel_for((projection.output_size, projection.input_size), rows)
        return QUANTIZED_KINDS.get((method.name, kernel))
    weight = cast(torch.Tensor, projection.weight)
    return NATIVE if isinstance(method, CpuLinearMethod) and method.takes_native(weight, rows) else TORCH
