"""The per-layer elementwise ops of the Llama family behind one seam: RMSNorm (alone and fused with
the residual add), SiLU-and-mul, rotary embeddings; and the sampler's argmax over the vocabulary.

`LayerOps` is the protocol the model calls; `TorchOps` is the reference (plain torch, runs anywhere,
several ops and temporaries each); `CpuOps` (layers/cpu_ops.py) runs each as one native pass.
`layer_ops` in EngineConfig picks one by name: `auto` is `cpu` where the native kernels build, else
`torch`. Both round to the storage dtype at the same points, so bfloat16 results agree.

The residual stream follows vLLM's form: a layer gets (hidden, residual) and returns them; the add
of a sublayer's output to the residual happens inside the next norm (`add_rms_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu_build import choose, native_choices
from tokenmill.layers.cpu_ops import CpuOps
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight; x [..., n] (the last dim contiguous), weight [n]."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual), x and residual [T, n]; may reuse both."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2n] -> [T, n]: silu(x[:, :n]) * x[:, n:]."""
        ...

    def rotary_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Whatever `rotate` needs for this step's positions [T]; computed once per forward."""
        ...

    def rotate(self, qk: torch.Tensor, inputs: Any) -> torch.Tensor:
        """qk [T, heads, D] (q and k heads side by side) rotated; may rotate it in place."""
        ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 -> [N] int64: each row's first largest value (NaN counts as largest), as torch."""
        ...


class TorchOps:
    """The reference: the Llama family's definitions in plain torch."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.cos_sin(positions, dtype)  # cos, sin [T, 1, D]

    def rotate(self, qk: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return apply_rotary(qk, *inputs)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)


_OPS: dict[str, Callable[[], LayerOps]] = native_choices("layer_ops", CpuOps, TorchOps)


def layer_ops_names() -> list[str]:
    return sorted(_OPS)


def get_layer_ops(name: str) -> LayerOps:
    """The layer ops by name; a ValueError lists the names there are."""
    return choose("layer_ops", _OPS, name)
