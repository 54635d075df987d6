"""`CpuOps`: the Llama family's per-layer elementwise ops as native CPU kernels (kernels/csrc/layer_ops.cpp).

Each op is one pass over its rows: RMSNorm, the residual add fused into the following RMSNorm (both
in place), SiLU-and-mul into a fresh [T, n], and rotary embeddings applied to q and k in place
inside the QKV projection's output (cos and sin looked up per token from the float32 tables); the
sampler's argmax, vectorized and parallel over rows (torch's reads a [32, 32000] batch at half the speed).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.cpu_build import CpuKernels
from tokenmill.layers.rotary import RotaryEmbedding


class CpuOps:
    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.ops = kernels.ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual) * weight
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2n] -> [T, n]
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        self.ops.silu_and_mul(out, x)
        return out

    def rotary_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions, rotary.cos, rotary.sin  # [T] int64; the tables [max_positions, D] float32

    def rotate(self, qk: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.ops.rotary(qk, *inputs)  # in place
        return qk

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [N, V] float32 -> [N] int64
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            return x.argmax(dim=-1)
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        self.ops.argmax_rows(out, x)
        return out
