"""`--quantization int8` kept in GGUF's Q8_0 blocks: `Int8BlocksMethod`.

Where a CPU kind runs Q8_0 blocks faster than tokenmill's int8 formats (the `gguf_layout` rule of
kernels/defaults.py: with AVX-512 VNNI and BF16 but no AMX, the blocks repacked in 16-row groups,
kernels/csrc/gguf_x16.cpp), a float checkpoint's projections are quantized at load into Q8_0 blocks
(int8 in groups of 32 with a float16 scale, `quantize.quantize_q8_0`: the bytes llama.cpp's q8_0 file
holds) and then kept and multiplied as a GGUF file's Q8_0 matrices are (quant/gguf_method.py): decode
rows by `gguf_linear`, prompt chunks by `gguf_gemm`, both with int8 activations in runs of 32 and
integer sums, and the fused decode's GGUF projection kind. The weights are a `GGUFMatrix`
(`layer.quantized`), which the quantized-weight cache stores as it stores the int formats.

A layer whose input width is not a multiple of 32 (no Q8_0 block fits) is quantized per channel into
`Int8Weight` and runs the int8 method's kernels: the two forms live side by side, each layer's own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels
from tokenmill.quant.gguf_method import GGUFMatrix, dequantize, repack, repackable
from tokenmill.quant.int_methods import FusedTensors, Int8LinearMethod, Kernel, QuantizedLinearMethod
from tokenmill.quant.method import FusedKind, Layer
from tokenmill.quant.quantize import Int8Weight, QuantSpec, quantize_q8_0

BLOCK = 32  # weights a Q8_0 block
MAX_DECODE_ROWS = 8  # `gguf_linear` up to this many rows, `gguf_gemm` past it (as GGUFBlocksMethod)
# the repacked layout's definition: the quantized-weight cache holds repacked bytes, so its key reads it
LAYOUT_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "csrc" / "gguf_x16_pack.h"


class Int8BlocksMethod(QuantizedLinearMethod):
    """int8 weight-only in Q8_0 blocks (module docstring); needs the native kernels."""

    name = "int8_blocks"
    default_kernel = "blocks"
    format = GGUFMatrix

    def __init__(self, spec: QuantSpec, kernels: CpuKernels, repack16: bool = True) -> None:
        super().__init__(spec, kernels)
        self.repack16 = repack16  # Q8_0's 16-row groups (the AVX-512 VNNI kernel) where rows allow
        self.per_channel = Int8LinearMethod(QuantSpec("int8"), kernels)  # layers no block fits

    def cache_tag(self) -> str:
        """What the cache key adds for this method: the repacked form's layout source."""
        return super().cache_tag() + f" repack16={self.repack16} {_layout_hash()}"

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().create_weights(layer, input_size, output_sizes, bias, dtype)
        layer.blocks_dtype = dtype  # the activations' dtype: the block kernels take float32 and bfloat16

    def process_weights_after_loading(self, layer: Layer) -> None:
        weight = layer.weight.data  # type: ignore[union-attr]  # [out, in]
        if weight.shape[1] % BLOCK:
            layer.quantized = self.per_channel.quantize(weight, weight.shape[1])  # type: ignore[assignment]
        else:
            matrix = GGUFMatrix("Q8_0", quantize_q8_0(weight), weight.shape[1])
            if self.repack16 and repackable(matrix):
                matrix = repack(matrix, self.ops)
            layer.quantized = matrix  # type: ignore[assignment]
        del layer.weight

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        return {"blocks": self._blocks, "dequant": self._dequant}

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(layer.quantized, Int8Weight):  # type: ignore[attr-defined]
            return self.per_channel.apply(layer, x, bias)
        return super().apply(layer, x, bias)

    def kernel_for(self, shape: tuple[int, int], rows: int) -> str:
        plan = self.plan.get(shape)
        return plan[min(rows, len(plan) - 1)] if plan is not None else self.default_kernel

    def _blocks(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = w if isinstance(w, GGUFMatrix) else None
        if m is None or x.dtype not in NATIVE_DTYPES:
            return self._dequant(w, x, bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(x.shape[0], m.shape[0], dtype=x.dtype)  # [M, N]
        op = self.ops.gguf_linear if x.shape[0] <= MAX_DECODE_ROWS else self.ops.gguf_gemm  # type: ignore[union-attr]
        op(out, x, m.data, m.type_number)
        if bias is not None:
            out += bias
        return out

    def _dequant(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = w if isinstance(w, GGUFMatrix) else None
        if m is None:
            raise TypeError(f"{self.name}: a layer's weights are a GGUFMatrix, got {type(w).__name__}")
        dense = dequantize(m, self.ops, x.dtype if x.dtype in NATIVE_DTYPES else torch.float32)  # [N, K]
        return torch.nn.functional.linear(x, dense.to(x.dtype), bias)

    # --- the fused decode: the GGUF projection kind (decode_layer.cpp), one run of Q8_0 ---
    def fusable(self, layer: Layer) -> bool:
        if isinstance(layer.quantized, Int8Weight):  # type: ignore[attr-defined]
            return self.per_channel.fusable(layer)
        return layer.blocks_dtype in NATIVE_DTYPES  # type: ignore[attr-defined]

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        if isinstance(layer.quantized, Int8Weight):  # type: ignore[attr-defined]
            return self.per_channel.fused_kind(layer, rows)
        shape = (layer.output_size, layer.input_size)
        return FusedKind.GGUF if rows <= MAX_DECODE_ROWS and self.kernel_for(shape, rows) == "blocks" else None

    def fused_tensors(self, layer: Layer) -> FusedTensors:
        m = layer.quantized  # type: ignore[attr-defined]
        if isinstance(m, Int8Weight):
            return self.per_channel.fused_tensors(layer)
        kinds = torch.tensor([m.type_number, -1, m.shape[0]], dtype=torch.int64)
        return m.data, kinds, None, 0

    def rows(self, layer: Layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        """Rows `ids` [T] of the layer's weights dequantized [T, in]: a tied embedding table read from its head."""
        m = layer.quantized  # type: ignore[attr-defined]
        if isinstance(m, Int8Weight):
            return self.per_channel.rows(layer, ids, dtype)
        out_dtype = dtype if dtype in NATIVE_DTYPES else torch.float32
        return dequantize(m, self.ops, out_dtype, ids=ids).to(dtype)


def _layout_hash() -> str:
    import hashlib

    return hashlib.sha256(LAYOUT_SOURCE.read_bytes()).hexdigest()[:16]
