"""Linear layers: the modules `Linear` (one output block) and `MergedLinear` (several named output
shards fused in one matmul: q/k/v into qkv, gate/up into gate_up), whose weights a `LinearMethod`
(quant/method.py) holds and applies.

A layer asks for its method at construction (the model passes the one `QuantConfig.method_for`
names for the layer's prefix and shape) and keeps it. A method names its parameters after the
checkpoint tensors' suffixes (`weight`, `bias`; a pre-quantized format's `qweight`, `scales`, ...),
so the model maps `...q_proj.<suffix>` to `...qkv_proj.<suffix>`; each carries a `weight_loader`
(the convention is in quant/method.py). A checkpoint that holds a layer quantized already (GGUF's
Q8_0 / Q4_x blocks) hands its loader the quantized weights instead of a tensor
(`PiecesLoader` in quant/method.py). Parameters without a `weight_loader` (embedding,
norms) are filled by `default_weight_loader`. The attribute lives on the Parameter object: load
before moving the model (`.to()` makes new ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import torch
from torch import nn

from tokenmill.quant.method import (
    LinearMethod,
    Shard,
    ShardId,
    UnquantizedLinearMethod,
    WeightLoader,
    WeightLoadError,
    copy_checked,
)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
    """A whole, unfused parameter (embedding table, norm weight)."""
    if shard_id is not None:
        raise WeightLoadError(f"shard {shard_id!r} sent to an unfused parameter")
    copy_checked(param.data, loaded, shard_id)


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or `default_weight_loader` for one that has none."""
    return cast(WeightLoader, getattr(param, "weight_loader", default_weight_loader))


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

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def map_held_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Each tensor the method keeps outside the parameters and buffers replaced by fn(tensor)."""
        self.linear_method.map_held(self, fn)

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
