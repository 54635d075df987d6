"""RMSNorm as a module: its weight and epsilon; the arithmetic is the injected `LayerOps`' (float32
inside, cast back, as the Llama family defines it)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim], same dtype
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), both [T, dim]; x and residual may be reused."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
