"""The seam quantization plugs into: `LinearMethod`, the weight-loader pieces, the dense method.

A linear layer (`layers/linear.py`) asks its `LinearMethod` to create its parameters, to fill them
from a checkpoint, to repack them after loading and to apply them; one method instance serves every
layer that uses it (per-layer state lives on the layer). Each method also states how the fused
decode (`layers/fused_decode.py`, `kernels/csrc/decode_layer.cpp`) can chain its products: whether
it can at all (`fusable`), which of the native projection kinds a product at a row count is
(`fused_kind`), and the tensors the native layer reads (`fused_tensors`). A method that keeps a
layer's weights outside its parameters and buffers (a quantized form, a GGUF file's blocks) hands them
to `map_held`, so that what re-homes a model's tensors (runner/huge_pages.py) reaches them too.

The weight-loader convention: every parameter a method registers carries a `weight_loader`
attribute, called as `param.weight_loader(param, loaded, shard_id)` with one checkpoint tensor. It
checks `loaded`'s shape against the place it goes and copies it there once (dtype conversion
included in that one copy), or raises `WeightShapeError`. `shard_id` is None for an unfused layer,
and the shard's name for a fused one ("q", "k", "v" or "gate", "up" in the Llama family).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

ShardId = str | None  # None: the layer is not fused; otherwise the name of one of its output shards
Shape = tuple[int, int]  # a dense weight's (out, in)
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# What a method sees of its layer (layers.linear.LinearBase): input_size, output_size, output_sizes,
# shards, bias, and the parameters and buffers the method registers on it.
Layer = Any


class FusedKind:
    """decode_layer.cpp's projection kinds: how the native layer runs one projection's product."""

    TORCH, NATIVE, INT8, W8A8, INT4PACK, INT4, INT8_TILED, W8A8_TILED, W8A8_AMX, INT8_AMX, INT4_AMX, GGUF = range(12)


def map_tensors(held: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A frozen dataclass of tensors (a quantized weight, a GGUF matrix) with each tensor field
    replaced by fn(field); anything else as it is."""
    if not is_dataclass(held) or isinstance(held, type):
        return held
    changed = {f.name: fn(v) for f in fields(held) if isinstance(v := getattr(held, f.name), torch.Tensor)}
    return replace(held, **changed) if changed else held


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


@dataclass(frozen=True)
class PiecesLoader:
    """The weight loader of a layer whose checkpoint holds its shards in a stored form (GGUF's blocks:
    `GGUFMatrix`, or tokenmill's `Int8Weight` / `Int4Weight` for Q8_0 / Q4_0 / Q4_1): each shard
    arrives as one `format` object with a `shape` [rows, in] and waits in `pieces` until the method
    joins them after loading (`wait_for_pieces`)."""

    shards: Mapping[ShardId, Shard]
    input_size: int
    format: type
    pieces: dict[ShardId, Any]

    def __call__(self, param: nn.Parameter, loaded: object, shard_id: ShardId) -> None:
        shard = self.shards.get(shard_id)
        if shard is None:
            names = ", ".join(repr(s) for s in self.shards)
            raise WeightLoadError(f"no shard {shard_id!r} in this layer (its shards: {names})")
        if not isinstance(loaded, self.format):
            raise WeightLoadError(f"expected {self.format.__name__}, got {type(loaded).__name__}")
        shape = tuple(loaded.shape)  # type: ignore[attr-defined]
        if shape != (shard.size, self.input_size):
            raise WeightShapeError(shape, (shard.size, self.input_size), shard_id)
        self.pieces[shard_id] = loaded


def wait_for_pieces(layer: Layer, input_size: int, format: type) -> dict[ShardId, Any]:
    """Register the layer's placeholder `weight`, whose `PiecesLoader` collects each shard's stored
    object into the returned dict (by shard id); the method drops the placeholder once it has joined
    them."""
    pieces: dict[ShardId, Any] = {}
    placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
    layer.register_parameter(
        "weight", set_weight_loader(placeholder, PiecesLoader(layer.shards, input_size, format, pieces))
    )
    return pieces


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def register_bias(layer: Layer, dtype: torch.dtype) -> None:
    """A [output_size] bias whose loader places each shard's rows."""
    bias = nn.Parameter(torch.empty(layer.output_size, dtype=dtype), requires_grad=False)
    layer.register_parameter("bias", set_weight_loader(bias, ShardLoader(layer.shards)))


class LinearMethod(Protocol):
    """How a linear layer holds and applies its weights. One instance serves every layer of a model;
    per-layer state lives in the layer's parameters and buffers. Subclass it explicitly to inherit the
    defaults (no repacking after loading; not chained by the fused decode)."""

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        """Register `layer`'s parameters (each with a `weight_loader`), including a `bias` of
        sum(output_sizes) when `bias` is true; `layer.shards` says where each output shard goes."""
        ...

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> x @ W^T (+ bias): [..., sum(output_sizes)] in x's dtype."""
        ...

    def process_weights_after_loading(self, layer: Layer) -> None:
        """Called once per layer after every checkpoint tensor is in place: repack, quantize, transpose."""
        return None

    def fusable(self, layer: Layer) -> bool:
        """Whether the fused decode can chain this layer's products at all."""
        return False

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        """The `FusedKind` of this layer's product at `rows` input rows; None: the modules run it."""
        return None

    def fused_tensors(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """(weight, scales, wsums, group) as decode_layer.cpp takes them for this layer."""
        raise NotImplementedError

    def map_held(self, layer: Layer, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each tensor this method keeps on `layer` outside its parameters and buffers by
        fn(tensor) (none for a method whose weights are parameters)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """One dense weight [sum(output_sizes), input_size] in the model's dtype; y = F.linear(x, W, b)."""

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)  # [out, in]
        layer.register_parameter(
            "weight", set_weight_loader(nn.Parameter(weight, requires_grad=False), ShardLoader(layer.shards))
        )
        if bias:
            register_bias(layer, dtype)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, shape: Shape | None = None
    ) -> torch.Tensor:  # x [M, in], weight [out, in] -> [M, out]
        """x @ weight^T (+ bias) for a dense weight that is not a layer's (a tied embedding table, a
        slice of the output projection); `shape`: the whole weight's (out, in) when `weight` is a slice."""
        return F.linear(x, weight, bias)

    def fusable(self, layer: Layer) -> bool:
        return True

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        return FusedKind.TORCH

    def fused_tensors(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        return cast(torch.Tensor, layer.weight), None, None, layer.input_size
