"""Linear layers and the seam quantization plugs into.

Owns `LinearMethod` (how a linear layer's weights are created, filled from a checkpoint, repacked
after loading and applied), `UnquantizedLinearMethod` (one dense weight, `F.linear`), the modules
`Linear` (one output block) and `MergedLinear` (several named output shards fused in one matmul:
q/k/v into qkv, gate/up into gate_up), and the weight-loader convention the model loader relies on.

The weight-loader convention: every parameter a method registers carries a `weight_loader`
attribute, called as `param.weight_loader(param, loaded, shard_id)` with one checkpoint tensor. It
checks `loaded`'s shape against the place it goes and copies it there once (dtype conversion
included in that one copy), or raises `WeightShapeError`. `shard_id` is None for a `Linear`, and
the shard's name for a `MergedLinear` ("q", "k", "v" or "gate", "up" in the Llama family). A
method names its parameters after the checkpoint tensors' suffixes (`weight`, `bias`; a pre-quantized
format's `qweight`, `scales`, ...), so the model maps `...q_proj.<suffix>` to `...qkv_proj.<suffix>`.
A checkpoint that holds a layer quantized already (GGUF's Q8_0 / Q4_x blocks) hands its loader the
quantized weights instead of a tensor (`QuantizedShardLoader` in quant_linear.py); the layer is
switched to that method before loading (`LinearBase.use_method`).
Parameters without a `weight_loader` (embedding, norms) are filled by `default_weight_loader`.
The attribute lives on the Parameter object: load before moving the model (`.to()` makes new ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

ShardId = str | None  # None: the layer is not fused; otherwise the name of one of its output shards
Shape = tuple[int, int]  # a dense weight's (out, in)
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit the parameter it was sent to."""


class WeightShapeError(WeightLoadError):
    """A checkpoint tensor whose shape differs from its place's (the whole parameter or one shard)."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...], shard_id: ShardId) -> None:
        where = "the parameter" if shard_id is None else f"shard {shard_id!r}"
        super().__init__(f"tensor of shape {list(got)} does not fit {where}, of shape {list(expected)}")
        self.got, self.expected, self.shard_id = got, expected, shard_id


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a layer's output."""

    start: int
    size: int


def copy_checked(dst: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId) -> None:
    """The one copy of a checkpoint tensor into its place, after the shape check."""
    if tuple(loaded.shape) != tuple(dst.shape):
        raise WeightShapeError(tuple(loaded.shape), tuple(dst.shape), shard_id)
    dst.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
    """A whole, unfused parameter (embedding table, norm weight)."""
    if shard_id is not None:
        raise WeightLoadError(f"shard {shard_id!r} sent to an unfused parameter")
    copy_checked(param.data, loaded, shard_id)


@dataclass(frozen=True)
class ShardLoader:
    """A weight loader for a parameter whose dimension `dim` holds the layer's output shards
    (dim 0 for a dense [out, in] weight and a bias; dim 1 for a method storing [in, out])."""

    shards: Mapping[ShardId, Shard]
    dim: int = 0

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        shard = self.shards.get(shard_id)
        if shard is None:
            names = ", ".join(repr(s) for s in self.shards)
            raise WeightLoadError(f"no shard {shard_id!r} in this layer (its shards: {names})")
        copy_checked(param.data.narrow(self.dim, shard.start, shard.size), loaded, shard_id)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or `default_weight_loader` for one that has none."""
    return cast(WeightLoader, getattr(param, "weight_loader", default_weight_loader))


class LinearMethod(Protocol):
    """How a linear layer holds and applies its weights. One instance serves every layer of a model;
    per-layer state lives in the layer's parameters and buffers. Subclass it explicitly to inherit the
    no-op `process_weights_after_loading`."""

    def create_weights(
        self, layer: LinearBase, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        """Register `layer`'s parameters (each with a `weight_loader`), including a `bias` of
        sum(output_sizes) when `bias` is true; `layer.shards` says where each output shard goes."""
        ...

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> x @ W^T (+ bias): [..., sum(output_sizes)] in x's dtype."""
        ...

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once per layer after every checkpoint tensor is in place: repack, quantize, transpose."""
        return None


def register_bias(layer: LinearBase, dtype: torch.dtype) -> None:
    """A [output_size] bias whose loader places each shard's rows."""
    bias = nn.Parameter(torch.empty(layer.output_size, dtype=dtype), requires_grad=False)
    layer.register_parameter("bias", set_weight_loader(bias, ShardLoader(layer.shards)))


class UnquantizedLinearMethod(LinearMethod):
    """One dense weight [sum(output_sizes), input_size] in the model's dtype; y = F.linear(x, W, b)."""

    def create_weights(
        self, layer: LinearBase, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)  # [out, in]
        layer.register_parameter(
            "weight", set_weight_loader(nn.Parameter(weight, requires_grad=False), ShardLoader(layer.shards))
        )
        if bias:
            register_bias(layer, dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, shape: Shape | None = None
    ) -> torch.Tensor:  # x [M, in], weight [out, in] -> [M, out]
        """x @ weight^T (+ bias) for a dense weight that is not a layer's (a tied embedding table, a
        slice of the output projection); `shape`: the whole weight's (out, in) when `weight` is a slice."""
        return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b), its weights held and applied by a `LinearMethod`; the output is one or several
    shards laid end to end (`shards`: shard id -> its rows of the output)."""

    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_sizes: Mapping[ShardId, int],
        bias: bool,
        linear_method: LinearMethod | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes.values())
        self.output_size = sum(self.output_sizes)
        starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.shards = {sid: Shard(start, size) for (sid, size), start in zip(output_sizes.items(), starts, strict=True)}
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.register_parameter("bias", None)  # the method replaces it when `bias` is true
        self.linear_method.create_weights(self, input_size, self.output_sizes, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., output_size]
        return self.linear_method.apply(self, x, self.bias)

    def use_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Hold this layer's weights with `method` instead: its parameters are made anew (before loading)."""
        bias = self.bias is not None
        for name in list(self._parameters):
            del self._parameters[name]
        self.register_parameter("bias", None)
        self.linear_method = method
        method.create_weights(self, self.input_size, self.output_sizes, bias, dtype)

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        shards = ", ".join(f"{sid}={s.size}" for sid, s in self.shards.items() if sid is not None)
        outputs = f"[{shards}]" if shards else str(self.output_size)
        method = type(self.linear_method).__name__
        return f"in={self.input_size}, out={outputs}, bias={self.bias is not None}, method={method}"


class Linear(LinearBase):
    """An unfused linear layer: its weight loader takes shard id None."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(input_size, {None: output_size}, bias, linear_method, dtype)


class MergedLinear(LinearBase):
    """Several linear layers over the same input fused in one: `output_sizes` names each shard and
    its size, in output order (e.g. {"q": q_size, "k": kv_size, "v": kv_size})."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Mapping[str, int],
        *,
        bias: bool = False,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not output_sizes:
            raise ValueError("output_sizes: a merged layer needs at least one shard")
        shards: dict[ShardId, int] = {name: size for name, size in output_sizes.items()}
        super().__init__(input_size, shards, bias, linear_method, dtype)
