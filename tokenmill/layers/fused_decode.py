"""Decoder layers as one native call each, for steps without prompt chunks on the CPU kernels.

`FusedDecode` runs a `DecoderLayer` through `kernels/csrc/decode_layer.cpp`, which chains the same
native ops the layer's modules call one by one (norms, projections, rotary, KV write, paged
attention, SwiGLU) in the same order, so its outputs equal the modules' to the bit; what it removes
is the Python between them (~20 torch calls and ~10 module calls a layer: the decode step 1.04-1.09x
faster at 1-16 sequences on a 2-core machine, `benchmarks/fused_decode.py`). It applies where every piece is the
native one (the `cpu` attention backend and layer ops, dense weights), to steps whose every
sequence the paged kernel attends (no prompt chunk for SDPA) and without padding rows; each
projection keeps its linear method's choice of kernel for the step's row count. Anything else
runs the modules.
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

if TYPE_CHECKING:
    from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM


class FusedDecode:
    def __init__(self, kernels: CpuKernels) -> None:
        self._op = kernels.ops.decode_layer.default

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether `model` runs entirely on the pieces the fused layer chains."""
        layers = cast("list[DecoderLayer]", list(model.layers))
        if not layers or model.config.qk_norm or not isinstance(model.ops, CpuOps):
            return False
        attn = layers[0].self_attn
        if not isinstance(attn.backend, CpuPagedBackend):
            return False
        projections = [attn.qkv_proj, attn.o_proj, layers[0].mlp.gate_up_proj, layers[0].mlp.down_proj]
        return all(type(p.linear_method) in (CpuLinearMethod, UnquantizedLinearMethod) for p in projections)

    def plan(self, layer: DecoderLayer, x: torch.Tensor, metadata: AttentionMetadata) -> list[bool] | None:
        """For a step: each projection's kernel (True: native) at the step's row count, the same for
        every layer; None when the step has a prompt chunk or padding (the modules run it)."""
        md = metadata
        if not isinstance(md, CpuMetadata) or md.prefills or md.num_actual_tokens != x.shape[0]:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        rows = x.shape[0]
        return [_native(p, rows) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]

    def __call__(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,
        rope: object,  # CpuOps.rotary_inputs: positions, cos, sin
        cache: KVCache,
        metadata: CpuMetadata,
        native: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # as DecoderLayer.forward
        attn, mlp = layer.self_attn, layer.mlp
        positions, cos, sin = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], rope)
        md = metadata
        out, res = self._op(
            x, residual, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            layer.input_layernorm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            attn.o_proj.bias, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight,
            mlp.down_proj.bias, native, attn.num_heads, attn.num_kv_heads, attn.head_dim, positions, cos, sin,
            cache.k, cache.v, md.slot_mapping, md.block_tables, md.seq_lens, md.query_starts, md.query_lens,
            md.block_size, attn.scale, attn.sliding_window,
        )  # fmt: skip
        return out, res


def _native(projection: LinearBase, rows: int) -> bool:
    method = projection.linear_method
    weight = cast(torch.Tensor, projection.weight)
    return isinstance(method, CpuLinearMethod) and method.takes_native(weight, rows)
