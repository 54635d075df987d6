"""Quantized linear methods: int8 and int4 weight-only, and W8A8, behind the linear seam.

Each method loads the checkpoint's dense weight as `UnquantizedLinearMethod` does (same parameter,
same weight loader), then quantizes it in `process_weights_after_loading` (quant/quantize.py) and
drops the dense copy: the layer keeps `layer.quantized` (an `Int8Weight`, `Int4Weight` or
`Int4PackWeight`). A product
runs one of the method's kernels, chosen per weight shape and row count (`plan`, filled by
`tune_quantized` from timings on the CPU at hand through the autotune cache, as the dense plan is;
a shape missing from the plan takes `default_kernel`):
- `int8` weight-only: `native` (kernels/csrc/linear_int8.cpp: few rows, the weights read once),
  `tiled` (per channel: 4 weight rows x 4 input rows at a time, for batches), `amx` (bfloat16
  activations where the CPU has AMX: the weights widened to bfloat16 tiles as they are read) or
  `dequant` (the layer's weights dequantized to the activations' dtype, then torch's GEMM: prompt
  chunks, where arithmetic and not weight reads bound the product; the memory saving stays, the
  dense copy lives for the one product) or `gemm` (per channel, AVX-512 VNNI builds, a candidate for
  tuning: the activations rounded to int8 in runs of 256, as llama.cpp's for its K-quant products,
  integer products on the weights as stored, kernels/csrc/linear_int8_gemm.cpp).
- `w8a8`: per-channel int8 weights, activations quantized per row at run time; `native` (integer dot
  products, VNNI where the CPU has it), `tiled` (as int8's), `amx` (AMX's int8 tiles, where the CPU
  has them) or `int_mm` (torch's integer GEMM `torch._int_mm` after the same per-row quantization).
- `int4` weight-only, asymmetric groups: `native` (kernels/csrc/linear_int4.cpp, tokenmill's layout;
  the activations rounded to int8 in runs of 32, as llama.cpp's Q8_0 activations), `amx` (as int8's,
  each group dequantized to bfloat16 as it is read), `dequant` or, for bfloat16 activations,
  `dequant32` (float32 weights and a float32 GEMM: the many-row kernel where the CPU has no bfloat16
  arithmetic and torch emulates its bfloat16 GEMM), `gemm` (`native`'s arithmetic, its loops ordered for
  many rows: each tile's weights kept in L1 over every block of rows), `widened` (AVX2: float32
  outer-product tiles, each tile of weight rows dequantized in cache, kernels/csrc/linear_int4_wide.cpp);
  where the native kernels do not build, torch's layout and `int4pack` (torch's CPU int4 kernel, bfloat16
  activations: float32 ones are rounded to bfloat16 for it, as its float32 path is many times slower)
  or `dequant`.
torchao 0.18 (the release for torch 2.13) was measured first (benchmarks/torchao_probe.py): its int8
configs ran slower than the dense bfloat16 layers they replace, and its int4 config has no CPU packing
format there (plain and preshuffled need mslk, plain_int32 refuses the CPU, tile_packed_to_4d needs
CUDA). So the ops are called directly. Choosing among the kernels by timing is quant/tuning.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu_build import CpuKernels
from tokenmill.quant.gguf_method import GGUFMatrix
from tokenmill.quant.method import (
    FusedKind,
    Layer,
    LinearMethod,
    Shape,
    ShardId,
    ShardLoader,
    map_tensors,
    register_bias,
    set_weight_loader,
    wait_for_pieces,
)
from tokenmill.quant.quantize import (
    Int4PackWeight,
    Int4Weight,
    Int8Weight,
    QuantSpec,
    choose_group,
    concat_rows,
    dequantize_int4,
    dequantize_int4pack,
    dequantize_int8,
    int4_rows,
    int4pack_rows,
    int8_rows,
    int8_rows_symmetric,
    quantize_int4,
    quantize_int4pack,
    quantize_int8,
)

logger = logging.getLogger("tokenmill")

Kernel = Callable[[object, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (weight, x [M, K], bias) -> [M, N]
FusedTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]  # weight, scales, wsums, group

# (method name, kernel name) -> decode_layer.cpp's projection kind (a checkpoint's int4 / int8 layers,
# AWQ, GPTQ or compressed-tensors, are the same formats once loaded, under the same names)
FUSED_KINDS = {
    ("int8", "native"): FusedKind.INT8,
    ("w8a8", "native"): FusedKind.W8A8,
    ("int4", "int4pack"): FusedKind.INT4PACK,
    ("int4", "native"): FusedKind.INT4,
    ("int8", "tiled"): FusedKind.INT8_TILED,
    ("w8a8", "tiled"): FusedKind.W8A8_TILED,
    ("w8a8", "amx"): FusedKind.W8A8_AMX,
    ("int8", "amx"): FusedKind.INT8_AMX,
    ("int4", "amx"): FusedKind.INT4_AMX,
}


class HeadRows(nn.Module):
    """An embedding table read from a tied output projection's quantized weights (the dense table
    dropped): each looked-up row dequantized."""

    def __init__(self, head: Layer, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # not a submodule: the head stays where it is
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        head = self.head[0]
        return cast(QuantizedLinearMethod, head.linear_method).rows(head, ids, self.dtype)

    def blocks(self) -> GGUFMatrix | None:
        """The head's weights where they are GGUF blocks (int8 / int4 kept in Q8_0 / Q4_1 blocks,
        quant/int_blocks.py), as the native decode run looks rows up in; None for the int formats."""
        held = getattr(self.head[0], "quantized", None)
        return held if isinstance(held, GGUFMatrix) else None

    def int_weights(self) -> Int8Weight | Int4Weight | None:
        """The head's weights where it holds tokenmill's int8 or int4 format (int8, W8A8, int4 in tiles):
        the native decode run dequantizes their rows itself. None for the other formats."""
        held = getattr(self.head[0], "quantized", None)
        return held if isinstance(held, Int8Weight | Int4Weight) else None


class QuantizedLinearMethod(LinearMethod):
    """A dense weight at load, quantized after it (or, `prequantized`, the checkpoint's quantized
    weights as they are); products by the kernel the plan names for the weight's shape at the input's
    row count."""

    name = "quantized"
    default_kernel = "dequant"
    format: type = object  # the quantized weights this method holds
    # kernels kept to decode batches (at most this many rows), whatever they time at more
    row_limits: ClassVar[Mapping[str, int]] = {}

    def __init__(self, spec: QuantSpec, kernels: CpuKernels | None, prequantized: bool = False) -> None:
        self.spec = spec
        self.ops = kernels.ops if kernels is not None else None
        self.prequantized = prequantized
        self.plan: dict[Shape, tuple[str, ...]] = {}  # (out, in) -> kernel name by row count (tune_row_classes)
        self._kernels: dict[torch.dtype, dict[str, Kernel]] = {}

    # --- loading ---
    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        if self.prequantized:  # a placeholder whose loader collects the shards' quantized weights
            layer.quantized_pieces = wait_for_pieces(layer, input_size, self.format)
        else:
            weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)  # [out, in]: dropped once quantized
            layer.register_parameter(
                "weight", set_weight_loader(nn.Parameter(weight, requires_grad=False), ShardLoader(layer.shards))
            )
        if bias:
            register_bias(layer, dtype)

    def process_weights_after_loading(self, layer: Layer) -> None:
        if self.prequantized:
            pieces = cast(dict[ShardId, Int8Weight | Int4Weight], layer.quantized_pieces)
            layer.quantized = concat_rows([pieces[sid] for sid in layer.shards])  # type: ignore[arg-type, assignment]
            del layer.quantized_pieces, layer.weight
            return
        weight = cast(torch.Tensor, layer.weight)
        group = choose_group(self.spec, weight.shape[1], "this layer")
        layer.quantized = self.quantize(weight.data, group)  # type: ignore[assignment]
        del layer.weight  # the parameter goes; the layer holds only the quantized form

    def quantize(self, weight: torch.Tensor, group: int) -> object:
        raise NotImplementedError

    def map_held(self, layer: Layer, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if hasattr(layer, "quantized"):  # (a plain attribute: the quantized form's tensors)
            layer.quantized = map_tensors(layer.quantized, fn)

    def cache_tag(self) -> str:
        """What the quantized-weight cache's key holds of this method (runner/quantized_cache.py)."""
        return f"{type(self).__name__} {self.spec} native={self.ops is not None}"

    # --- products ---
    def kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        """The kernels this method can run here for activations of `dtype`, by name."""
        if dtype not in self._kernels:
            self._kernels[dtype] = self.make_kernels(dtype)
        return self._kernels[dtype]

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        raise NotImplementedError

    def amx_bf16(self, dtype: torch.dtype) -> bool:
        """Whether the AMX bfloat16-tile kernels run: bfloat16 activations, tiles built and granted."""
        return dtype == torch.bfloat16 and self.ops is not None and bool(self.ops.amx_bf16_ready())

    def kernel_for(self, shape: Shape, rows: int) -> str:
        plan = self.plan.get(shape)
        if plan is not None:
            return plan[min(rows, len(plan) - 1)]
        return self.default_kernel if rows <= self.row_limits.get(self.default_kernel, rows) else "dequant"

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = (layer.output_size, layer.input_size)
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        kernel = self.kernels(x.dtype)[self.kernel_for(shape, rows.shape[0])]
        out = kernel(layer.quantized, rows, bias)  # type: ignore[attr-defined]
        return out if x.dim() == 2 else out.view(*x.shape[:-1], shape[0])

    # --- the fused decode ---
    def fusable(self, layer: Layer) -> bool:
        # (a layer that gathers its inputs in another order first, GPTQ's activation order: the modules)
        return "input_order" not in layer._buffers

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        # (a dequantize-then-GEMM or torch integer GEMM product is not chained: None)
        return FUSED_KINDS.get((self.name, self.kernel_for((layer.output_size, layer.input_size), rows)))

    def fused_tensors(self, layer: Layer) -> FusedTensors:
        w = layer.quantized
        if isinstance(w, Int8Weight):
            return w.q, w.scales, w.wsums, w.group
        if isinstance(w, Int4PackWeight):
            return w.packed, w.scales_zeros, None, w.group
        return w.packed, w.scales, w.mins, w.group  # Int4Weight: its mins where the W8A8 kernel takes row sums

    @staticmethod
    def rows(layer: Layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # ids [T] -> [T, in]
        """Rows `ids` of the layer's weights, dequantized: a tied embedding table read from its head."""
        w = layer.quantized  # type: ignore[attr-defined]
        if isinstance(w, Int8Weight):
            return int8_rows(w, ids).to(dtype)
        if isinstance(w, Int4Weight):
            return int4_rows(w, ids).to(dtype)
        return int4pack_rows(cast(Int4PackWeight, w), ids).to(dtype)


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Int8LinearMethod(QuantizedLinearMethod):
    """int8 weight-only, per output channel or per group."""

    name = "int8"
    format = Int8Weight

    def __init__(self, spec: QuantSpec, kernels: CpuKernels | None, prequantized: bool = False) -> None:
        super().__init__(spec, kernels, prequantized)
        self.default_kernel = "native" if self.ops is not None else "dequant"

    def quantize(self, weight: torch.Tensor, group: int) -> Int8Weight:
        return quantize_int8(weight, group)

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        out: dict[str, Kernel] = {"dequant": self._dequant}
        if self.ops is not None:
            out["native"] = partial(self._native, mode=0)
            if self.spec.group_size is None:  # per channel: the tiled loop too
                out["tiled"] = partial(self._native, mode=1)
            # the outer-product tiles (AVX2, 16 rows and more; elsewhere the kernel runs `tiled`'s loop)
            out["broadcast"] = partial(self._native, mode=3)
            if self.spec.group_size is None and self.ops.int8_gemm_built():
                out["gemm"] = self._gemm  # int8 activations in runs of 256 (AVX-512 VNNI)
            if self.amx_bf16(dtype):
                out["amx"] = partial(self._native, mode=2)
        return out

    def _native(self, w: object, x: torch.Tensor, bias: torch.Tensor | None, mode: int) -> torch.Tensor:
        q = cast(Int8Weight, w)
        x = _contiguous_rows(x)
        out = torch.empty(x.shape[0], q.q.shape[0], dtype=x.dtype)  # [M, N]
        self.ops.linear_int8(out, x, q.q, q.scales, q.group, bias, mode)  # type: ignore[union-attr]
        return out

    def _gemm(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Many rows with int8 activations (kernels/csrc/linear_int8_gemm.cpp: x rounded in runs of 256
        k, vpdpbusd on the weights as stored); an input width off its 64-k steps is dequantized."""
        q = cast(Int8Weight, w)
        if q.q.shape[1] % 64 or q.group != q.q.shape[1]:
            return self._dequant(w, x, bias)
        x = _contiguous_rows(x)
        out = torch.empty(x.shape[0], q.q.shape[0], dtype=x.dtype)  # [M, N]
        self.ops.linear_int8_gemm(out, x, q.q, q.scales.view(-1), bias)  # type: ignore[union-attr]
        return out

    def _dequant(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = cast(Int8Weight, w)
        if self.ops is None or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x, dequantize_int8(q, x.dtype), bias)
        dense = torch.empty(q.q.shape, dtype=x.dtype)  # [N, K]: `dequantize_int8`'s values, one pass
        self.ops.dequant_int8(dense, q.q, q.scales, q.group)
        return F.linear(x, dense, bias)


class W8A8LinearMethod(QuantizedLinearMethod):
    """int8 weights per output channel, int8 activations per row (dynamic), integer products."""

    name = "w8a8"

    def __init__(self, spec: QuantSpec, kernels: CpuKernels | None) -> None:
        super().__init__(spec, kernels)
        self.default_kernel = "native" if self.ops is not None else "int_mm"

    def quantize(self, weight: torch.Tensor, group: int) -> Int8Weight:
        return quantize_int8(weight, group)  # group: the input width (choose_group refuses others)

    def fused_tensors(self, layer: Layer) -> FusedTensors:
        w = cast(Int8Weight, layer.quantized)
        return w.q, w.scales.view(-1), w.wsums, w.group

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        out: dict[str, Kernel] = {"int_mm": self._int_mm}
        if self.ops is not None:
            out["native"] = partial(self._native, mode=0)
            out["tiled"] = partial(self._native, mode=1)
            if self.ops.w8a8_amx_ready():  # AMX's int8 tiles, where this CPU has them and Linux grants them
                out["amx"] = partial(self._native, mode=2)
        return out

    def _native(self, w: object, x: torch.Tensor, bias: torch.Tensor | None, mode: int) -> torch.Tensor:
        q = cast(Int8Weight, w)
        x = _contiguous_rows(x)
        out = torch.empty(x.shape[0], q.q.shape[0], dtype=x.dtype)
        self.ops.linear_w8a8(out, x, q.q, q.scales.view(-1), q.wsums, bias, mode)  # type: ignore[union-attr]
        return out

    def _int_mm(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = cast(Int8Weight, w)
        xq, xs = self.quantize_rows(_contiguous_rows(x))
        dots = torch._int_mm(xq, q.q.t())  # [M, N] int32
        out = dots.float() * xs[:, None] * q.scales.view(1, -1)
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (int8 [M, K], float32 scales [M]): symmetric, one scale a row."""
        if self.ops is not None:
            return cast(tuple[torch.Tensor, torch.Tensor], self.ops.quantize_rows(x))
        return int8_rows_symmetric(x)


class Int4LinearMethod(QuantizedLinearMethod):
    """int4 weight-only, asymmetric groups: tokenmill's layout and kernel, or (where the kernels do not
    build) torch's layout and CPU int4 kernel."""

    name = "int4"
    format = Int4Weight
    # `native` orders its loops for decode rows (each block of 8 rows over the thread's tiles); many
    # rows take `gemm` (the same arithmetic, each tile kept in L1 over every row block) or `widened`
    row_limits: ClassVar[Mapping[str, int]] = {"native": 8}

    def __init__(self, spec: QuantSpec, kernels: CpuKernels | None, prequantized: bool = False) -> None:
        super().__init__(spec, kernels, prequantized)
        # (a checkpoint's int4 weights stay in tokenmill's layout: torch's holds its scales in bfloat16)
        self.default_kernel = "native" if self.ops is not None else "dequant" if prequantized else "int4pack"

    def quantize(self, weight: torch.Tensor, group: int) -> Int4Weight | Int4PackWeight:
        return quantize_int4(weight, group) if self.ops is not None else quantize_int4pack(weight, group)

    def make_kernels(self, dtype: torch.dtype) -> dict[str, Kernel]:
        if self.ops is None:
            if self.prequantized:
                return {"dequant": self._dequant}
            return {"int4pack": self._int4pack, "dequant": self._dequant}
        out: dict[str, Kernel] = {"native": partial(self._native, amx=False), "dequant": self._dequant}
        if dtype == torch.bfloat16:
            out["dequant32"] = self._dequant32
        if self.ops.broadcast_tiles_built():
            out["widened"] = self._widened
        # the integer kernel's loops ordered for many rows (int8 activations in runs of 32, as llama.cpp's
        # Q8_0 activations for its 4-bit products)
        out["gemm"] = partial(self._native, amx=False, many_rows=True)
        if self.amx_bf16(dtype):
            out["amx"] = partial(self._native, amx=True)
        return out

    def _native(
        self, w: object, x: torch.Tensor, bias: torch.Tensor | None, amx: bool, many_rows: bool = False
    ) -> torch.Tensor:
        q = cast(Int4Weight, w)
        x = _contiguous_rows(x)
        out = torch.empty(x.shape[0], q.rows, dtype=x.dtype)
        ops = self.ops
        ops.linear_int4(out, x, q.packed, q.scales, q.mins, q.group, bias, amx, many_rows)  # type: ignore[union-attr]
        return out

    def _widened(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Many rows with the activations kept in float: each tile of weight rows dequantized to
        float32 in cache for the outer-product tiles (kernels/csrc/linear_int4_wide.cpp; AVX2)."""
        q = cast(Int4Weight, w)
        x = _contiguous_rows(x)
        out = torch.empty(x.shape[0], q.rows, dtype=x.dtype)  # [M, N]
        self.ops.linear_int4_wide(out, x, q.packed, q.scales, q.mins, q.group, bias)  # type: ignore[union-attr]
        return out

    @staticmethod
    def _int4pack(w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = cast(Int4PackWeight, w)
        xb = _contiguous_rows(x).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(xb, q.packed, q.group, q.scales_zeros)  # [M, N] bfloat16
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(x.dtype)

    def _dense(self, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:  # -> [N, K]
        """`dequantize_int4`'s values, through the native kernel (one pass) where it is built."""
        if self.ops is None or dtype not in (torch.float32, torch.bfloat16):
            return dequantize_int4(w, dtype)
        dense = torch.empty(w.shape, dtype=dtype)
        self.ops.dequant_int4(dense, w.packed, w.scales, w.mins, w.group)
        return dense

    def _dequant(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, Int4Weight):
            return F.linear(x, self._dense(w, x.dtype), bias)
        return F.linear(x, dequantize_int4pack(cast(Int4PackWeight, w), x.dtype), bias)

    def _dequant32(self, w: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bfloat16 activations through a float32 GEMM: the weights dequantized to float32 (as
        `dequantize_int4` computes them before its rounding to bfloat16), the rows widened, the product
        rounded back. On a CPU without bfloat16 arithmetic (AVX2 alone) torch's bfloat16 GEMM emulates
        every product; its float32 GEMM runs at the vector units' rate."""
        q = cast(Int4Weight, w)
        out = F.linear(x.float(), self._dense(q, torch.float32), None if bias is None else bias.float())
        return out.to(x.dtype)  # [M, N]


_METHODS: dict[str, type[QuantizedLinearMethod]] = {
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
    "w8a8": W8A8LinearMethod,
}


def get_quant_method(spec: QuantSpec, kernels: CpuKernels | None) -> QuantizedLinearMethod:
    """The method `spec` names (`quantization`); a ValueError lists the names there are."""
    cls = _METHODS.get(spec.method)
    if cls is None:
        names = ", ".join(("auto", "none", *_METHODS))
        raise ValueError(f"quantization: expected one of {names}, got {spec.method!r}")
    return cls(spec, kernels)


def get_head_method(spec: QuantSpec, kernels: CpuKernels | None) -> QuantizedLinearMethod | None:
    """The output projection's own method when `spec.head` asks for one (None: the layers')."""
    if spec.head == "same" or spec.head == spec.method:
        return None
    if spec.head != "int8":
        raise ValueError(f"quantization_head: expected one of same, int8, got {spec.head!r}")
    return Int8LinearMethod(QuantSpec("int8"), kernels)
