"""Every decoder layer as one native call, for steps the CPU kernels run whole (decodes, and prompt
chunks where the paged kernel attends them).

`FusedDecode` runs the model's `DecoderLayer`s through `kernels/csrc/decode_layer.cpp`, which chains
the same native ops the layers' modules call one by one (norms, projections, rotary, KV write, paged
attention, SwiGLU) in the same order, so its outputs equal the modules' to the bit; what it removes
is the Python between them (~20 torch calls and ~10 module calls a layer, then the call a layer
itself: see `benchmarks/fused_decode.py`). It applies where every piece is the
native one (the `cpu` attention backend and layer ops; dense, int8, W8A8, int4 or GGUF-block weights), to steps
whose every sequence the paged kernel attends (no prompt chunk for SDPA) and without padding rows;
each projection keeps its linear method's choice of kernel for the step's row count (a quantized
layer's dequantize-then-GEMM or torch integer GEMM is not chained: such a step runs the modules).
Anything else runs the modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from tokenmill.kernels.cpu_build import CpuKernels
from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.layers.backends.cpu_paged import CpuMetadata, CpuPagedBackend
from tokenmill.layers.cpu_ops import CpuOps
from tokenmill.layers.linear import LinearBase


class DecoderStack(Protocol):
    """What the fused decode reads of a model (models/llama.py's `LlamaForCausalLM`): its decoder
    layers (each with `input_layernorm`, `self_attn` (`qkv_proj`, `o_proj`, heads, `backend`),
    `post_attention_layernorm` and `mlp` (`gate_up_proj`, `down_proj`)), its config and its layer ops."""

    layers: nn.ModuleList
    config: object
    ops: object


EMBED_DENSE, EMBED_INT8_HEAD, EMBED_INT4_HEAD = -1, -2, -3  # GreedyTail.embed_type other than a GGML block type


@dataclass(frozen=True)
class GreedyTail:
    """What a greedy run needs past the layers (`FusedDecode.run`): the embedding table (`embed_type`
    EMBED_DENSE: dense [V, hidden]; a GGML block type: a GGUF file's blocks [V, row bytes]; EMBED_INT8_HEAD
    or EMBED_INT4_HEAD: a tied head's own weights in tokenmill's int8 or int4 format, their rows
    dequantized with the head's scales and mins), the final norm's weight, the output projection as
    decode_layer.cpp takes it ((weight, scales, wsums, group), bias, its kernel at the run's rows, its
    width) and the rotary tables."""

    embed: torch.Tensor
    norm: torch.Tensor
    head: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]
    bias: torch.Tensor | None
    kind: int
    vocab: int
    cos: torch.Tensor
    sin: torch.Tensor
    embed_type: int = EMBED_DENSE


class FusedDecode:
    """The decoder layers of one model as one native call a decode step (`decode_stack`): each layer's
    tensors gathered once here, so a step passes only what changes (hidden states, rotary inputs,
    caches, attention metadata). Build it once the weights are final: it keeps references to them."""

    def __init__(self, kernels: CpuKernels, model: DecoderStack) -> None:
        self._op = kernels.ops.decode_stack.default
        self._run = kernels.ops.decode_run.default
        layers = list(model.layers)
        self._norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._first = _projections(layers[0])  # every layer's kernel choices are the first's
        projections = [p for layer in layers for p in _projections(layer)]
        tensors = [p.linear_method.fused_tensors(p) for p in projections]  # (weight, scales, wsums, group)
        self._weights = [t[0] for t in tensors]
        self._scales = [t[1] for t in tensors]
        self._wsums = [t[2] for t in tensors]
        self._biases = [p.bias for p in projections]
        self._groups = [t[3] for t in tensors[: len(self._first)]]
        self._out_features = [p.output_size for p in self._first]
        self._windows = [layer.self_attn.sliding_window for layer in layers]
        attn = layers[0].self_attn
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self._eps = layers[0].input_layernorm.eps
        self._scale = attn.scale
        self._caches: tuple[list[KVCache], list[torch.Tensor], list[torch.Tensor | None]] | None = None

    @staticmethod
    def supports(model: DecoderStack) -> bool:
        """Whether `model` runs entirely on the pieces the fused layers chain (each projection's
        method says whether it can be chained: `LinearMethod.fusable`)."""
        layers = list(model.layers)
        if not layers or getattr(model.config, "qk_norm", False) or not isinstance(model.ops, CpuOps):
            return False
        attn = layers[0].self_attn
        if not isinstance(attn.backend, CpuPagedBackend):
            return False
        # (every layer runs the first's kernel choices: each projection's method must be the first's)
        first = _projections(layers[0])
        return all(
            p.linear_method.fusable(p) and p.linear_method is f.linear_method
            for layer in layers
            for p, f in zip(_projections(layer), first, strict=True)
        )

    def plan(self, x: torch.Tensor, metadata: AttentionMetadata) -> list[int] | None:
        """For a step: each projection's kernel (a decode_layer.cpp kind) at the step's row count, the
        same for every layer; None when the step has a prompt chunk for SDPA or padding, or a projection's
        kernel at this row count is not one the native layers chain (the modules run it)."""
        md = metadata
        if not isinstance(md, CpuMetadata) or md.prefills or md.num_actual_tokens != x.shape[0]:
            return None
        return self.kinds(x.shape[0])

    def kinds(self, rows: int) -> list[int] | None:
        """Each projection's kernel at `rows` rows (None: one the native layers do not chain)."""
        kinds = [p.linear_method.fused_kind(p, rows) for p in self._first]
        return None if None in kinds else cast(list[int], kinds)

    def run(
        self,
        ids: torch.Tensor,  # [B] int64: each sequence's token
        starts: torch.Tensor,  # [B] int64: its position
        tail: GreedyTail,
        caches: list[KVCache],
        block_tables: torch.Tensor,  # [B, W] int32, covering starts + steps tokens
        block_size: int,
        steps: int,
        kinds: list[int],
    ) -> torch.Tensor:  # [B, steps] int64: each step's argmax token, -1 where its logit was NaN
        """`steps` greedy decode steps in one native call (decode_layer.cpp's `decode_run`): the layers
        as `__call__` runs them, then the final norm, the head and the argmax, each step's token the next one's."""
        heads, kv_heads, head_dim = self._heads
        _, cache_tensors, cache_scales = self._flat_caches(caches)
        weight, scales, wsums, group = tail.head
        return cast(
            torch.Tensor,
            self._run(
                ids, starts, tail.embed, tail.embed_type, tail.norm, weight, tail.bias, scales, wsums, group,
                tail.kind, tail.vocab, steps, self._norms, self._weights, self._biases, self._scales, self._wsums,
                cache_tensors, cache_scales, self._eps, kinds, self._groups, self._out_features, heads, kv_heads,
                head_dim, tail.cos, tail.sin, block_tables, block_size, self._scale, self._windows,
            ),
        )  # fmt: skip

    def _flat_caches(
        self, caches: list[KVCache]
    ) -> tuple[list[KVCache], list[torch.Tensor], list[torch.Tensor | None]]:
        if self._caches is None or self._caches[0] is not caches:  # the same list every step: flattened once
            self._caches = (
                caches,
                [t for c in caches for t in (c.k, c.v)],
                [t for c in caches for t in (c.k_scale, c.v_scale)],
            )
        return self._caches

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
        _, cache_tensors, cache_scales = self._flat_caches(caches)
        out, res = self._op(
            x, self._norms, self._weights, self._biases, self._scales, self._wsums, cache_tensors, cache_scales,
            self._eps, kinds, self._groups, self._out_features,
            heads, kv_heads, head_dim, positions, cos, sin, md.slot_mapping, md.block_tables, md.seq_lens,
            md.query_starts, md.query_lens, md.block_size, self._scale, self._windows,
        )  # fmt: skip
        return out, res


def _projections(layer: nn.Module) -> tuple[LinearBase, LinearBase, LinearBase, LinearBase]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj  # type: ignore[return-value]
