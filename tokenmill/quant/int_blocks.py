"""`--quantization int8` and `int4` kept in GGUF's blocks: `BlocksQuantMethod`.

Where a CPU kind runs GGUF's 32-weight blocks faster than tokenmill's int formats (the `gguf_layout`
rule of kernels/defaults.py, and quant/config.py `in_blocks`: int8 and int4 with AVX-512 VNNI, int4 on
AVX2, the blocks repacked in 16-row groups: kernels/csrc/gguf_x16.cpp), a float checkpoint's
projections are quantized at load into blocks and then kept and multiplied as a GGUF file's matrices
are (quant/gguf_method.py): decode rows by `gguf_linear`, prompt chunks by `gguf_gemm`, both with int8
activations in runs of 32 and integer sums, and the fused decode's GGUF projection kind.

- int8 -> Q8_0 (`quantize.quantize_q8_0`): int8 in groups of 32 with a float16 scale, the bytes
  llama.cpp's q8_0 file holds for the same weights.
- int4 -> Q4_1 (`quantize.quantize_q4_1`): tokenmill's int4 grid (groups of 32, a float16 scale and
  minimum each, q in 0..15) in Q4_1's block layout: the same values as `--gguf-layout int`'s int4.

The weights are a `GGUFMatrix` (`layer.quantized`), which the quantized-weight cache stores as it
stores the int formats. A layer whose input width is not a multiple of 32 (no block fits) is quantized
into the int method's own format (int8 per channel; int4 as its method would, which needs 32 to
divide) and runs that method's kernels: the two forms live side by side, each layer's own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels
from tokenmill.quant.gguf_method import GGUFBlocksMethod, GGUFMatrix, dequantize, repack
from tokenmill.quant.int_methods import (
    FusedTensors,
    Int4LinearMethod,
    Int8LinearMethod,
    Kernel,
    QuantizedLinearMethod,
)
from tokenmill.quant.method import FusedKind, Layer
from tokenmill.quant.quantize import QuantSpec, choose_group, quantize_q4_1, quantize_q8_0

BLOCK = 32  # weights a Q8_0 / Q4_1 block
# the repacked layout's definition: the quantized-weight cache holds repacked bytes, so its key reads it
LAYOUT_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "csrc" / "gguf_x16_pack.h"
BLOCK_TYPES = {"int8": "Q8_0", "int4": "Q4_1"}  # the quantization -> the block type it is kept in
QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1}


class BlocksQuantMethod(QuantizedLinearMethod):
    """int8 or int4 weight-only in GGUF blocks (module docstring); needs the native kernels."""

    default_kernel = "blocks"
    format = GGUFMatrix

    def __init__(self, spec: QuantSpec, kernels: CpuKernels, repack16: bool | None = None) -> None:
        super().__init__(spec, kernels)
        self.name = f"{spec.method}_blocks"
        self.type_name = BLOCK_TYPES[spec.method]
        # a GGUF file's blocks method: which native product a row count takes, the repack into 16-row
        # groups (None: the CPU kind's rule, `gguf_repack`; rows allowing)
        self.blocks = GGUFBlocksMethod(kernels, repack=repack16)
        # layers no block fits: the int method's own format
        fallback = QuantSpec(spec.method)
        self.own: QuantizedLinearMethod = (
            Int8LinearMethod(fallback, kernels) if spec.method == "int8" else Int4LinearMethod(fallback, kernels)
        )

    def cache_tag(self) -> str:
        """What the cache key adds for this method: the repacked form's layout source."""
        layout = hashlib.sha256(LAYOUT_SOURCE.read_bytes()).hexdigest()[:16]
        return super().cache_tag() + f" repack16={','.join(sorted(self.blocks.repack_types))} {layout}"

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().create_weights(layer, input_size, output_sizes, bias, dtype)
        layer.blocks_dtype = dtype  # the activations' dtype: the block kernels take float32 and bfloat16

    def process_weights_after_loading(self, layer: Layer) -> None:
        weight = layer.weight.data  # type: ignore[union-attr]  # [out, in]
        k = weight.shape[1]
        if k % BLOCK:
            group = choose_group(self.own.spec, k, "this layer")  # (int8: per channel; int4: 32, as the int4 method)
            layer.quantized = self.own.quantize(weight, group)  # type: ignore[assignment]
        else:
            matrix = GGUFMatrix(self.type_name, QUANTIZERS[self.type_name](weight), k)
            if self.blocks.repacks(matrix):
                matrix = repack(matrix, self.ops)
            layer.quantized = matrix  # type: ignore[assignment]
        del layer.weight

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        return {"blocks": self._blocks, "dequant": self._dequant}

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(layer.quantized, GGUFMatrix):  # type: ignore[attr-defined]
            return self.own.apply(layer, x, bias)
        return super().apply(layer, x, bias)

    def _blocks(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = w if isinstance(w, GGUFMatrix) else None
        product = self.blocks.product(m.type_name, x, m.repacked) if m is not None else None
        if m is None or product is None:
            return self._dequant(w, x, bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(x.shape[0], m.shape[0], dtype=x.dtype)  # [M, N]
        getattr(self.ops, product)(out, x, m.data, m.type_number)
        if bias is not None:
            out += bias
        return out

    def _dequant(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = w if isinstance(w, GGUFMatrix) else None
        if m is None:
            raise TypeError(f"{self.name}: a layer's weights are a GGUFMatrix, got {type(w).__name__}")
        dense = dequantize(m, self.ops, x.dtype if x.dtype in NATIVE_DTYPES else torch.float32)  # [N, K]
        return torch.nn.functional.linear(x, dense.to(x.dtype), bias)

    # --- the fused decode: the GGUF projection kind (decode_layer.cpp), one run of blocks ---
    def fusable(self, layer: Layer) -> bool:
        if not isinstance(layer.quantized, GGUFMatrix):  # type: ignore[attr-defined]
            return self.own.fusable(layer)
        return layer.blocks_dtype in NATIVE_DTYPES  # type: ignore[attr-defined]

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        if not isinstance(layer.quantized, GGUFMatrix):  # type: ignore[attr-defined]
            return self.own.fused_kind(layer, rows)
        shape = (layer.output_size, layer.input_size)
        chained = rows <= self.blocks.max_native_rows and self.kernel_for(shape, rows) == "blocks"
        return FusedKind.GGUF if chained else None

    def fused_tensors(self, layer: Layer) -> FusedTensors:
        m = layer.quantized  # type: ignore[attr-defined]
        if not isinstance(m, GGUFMatrix):
            return self.own.fused_tensors(layer)
        kinds = torch.tensor([m.type_number, -1, m.shape[0]], dtype=torch.int64)
        return m.data, kinds, None, 0

    def rows(self, layer: Layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        """Rows `ids` [T] of the layer's weights dequantized [T, in]: a tied embedding table read from its head."""
        m = layer.quantized  # type: ignore[attr-defined]
        if not isinstance(m, GGUFMatrix):
            return self.own.rows(layer, ids, dtype)
        out_dtype = dtype if dtype in NATIVE_DTYPES else torch.float32
        return dequantize(m, self.ops, out_dtype, ids=ids).to(dtype)
