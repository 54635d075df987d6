"""GGUF matrices kept as the file's own blocks: `GGUFMatrix`, the linear method `GGUFBlocksMethod` and the
embedding table `GGUFEmbedding`.

A matrix of a block type (the K-quants Q3_K / Q4_K / Q5_K / Q6_K, and Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0,
the types llama.cpp's K-quant mixes fall back to where a row's width is not a multiple of 256) is
held as the bytes the file stores, [N, K / W * block bytes] uint8, W weights a block along a row: exact
by construction, and as many bytes as the file's. The native kernels (kernels/csrc/gguf_blocks.cpp)
read them: `gguf_linear` for few rows (decode steps: int8 activations, one scale per 256 for the
K-quants and per 32 for the rest, the blocks read once), `gguf_gemm` for more (prompt chunks: the
same int8 activations and integer sums, tiled so that each weight block is read once a product and
unpacked once per tile of x rows), and `gguf_dequant` for embedding lookups. The dequantized values
are the `gguf` package's, bit for bit. Without the native kernels (no compiler, float16 activations),
products dequantize a chunk of weight rows at a time (the `gguf` package's own dequantizer) into a
scratch buffer the method reuses, then take torch's GEMM.

A layer's Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 matrices (rows a multiple of 16) may be repacked once at
load into groups of 16 rows (`GGUFMatrix.repacked`, kernels/csrc/gguf_x16.cpp: the same bytes moved, 148
a row's block for Q4_K's 144 and 180 for Q5_K's 176, the others' sizes unchanged), whose products need
no horizontal sums: every type where the CPU has AVX-512 VNNI, all but Q8_0 on AVX2 (the rule
`gguf_repack`, kernels/defaults.py; `repacks_on`). `gguf_dequant` gives back the file's rows, and the K-quants'
products are the file blocks' bit for bit (the 32-weight types' x is rounded per 32 with integer sums,
not float ones).

A fused layer (q/k/v, gate/up) may mix types (Q4_K_M stores some v and down projections in Q6_K):
the layer keeps one matrix per run of shards of one type, each product writing its columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels, cpu_flags
from tokenmill.kernels.defaults import DECODE, PROMPT, CpuKind, default_choice
from tokenmill.quant.method import (
    FusedKind,
    Layer,
    LinearMethod,
    ShardId,
    WeightLoadError,
    WeightShapeError,
    map_tensors,
    register_bias,
    set_weight_loader,
    wait_for_pieces,
)

# type name -> (GGML type number, weights a block, bytes a block)
BLOCKS = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
BLOCK_TYPES = tuple(BLOCKS)
REPACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the types with a 16-row form (gguf_x16.cpp)
REPACK_FORMS = ("x16", "file")  # a repackable type's forms in memory (kernels/defaults.py `gguf_repack`)
REPACK_ROWS = 16
PROMPT_KERNELS = ("auto", "gemm", "widened", "dequant")  # GGUFBlocksMethod's products for many rows
MAX_NATIVE_ROWS = 8  # the decode product's rows at most; more take the prompt product (`gguf_gemm`)
SCRATCH_VALUES = 1 << 22  # dequantized values a prompt product holds at once (16 MiB in float32)


def row_bytes(type_name: str, cols: int) -> int:
    """Bytes a row of `cols` weights takes in `type_name`'s blocks (a ValueError if they do not fit)."""
    _, weights, size = BLOCKS[type_name]
    if cols % weights:
        raise ValueError(f"{type_name} blocks hold {weights} weights; a row of {cols} is not a whole number of them")
    return cols // weights * size


@dataclass(frozen=True)
class GGUFMatrix:
    """A [rows, cols] matrix as a GGUF file stores it: `data` [rows, row_bytes(type_name, cols)] uint8; or,
    `repacked`, the same blocks in groups of 16 rows (kernels/csrc/gguf_x16_pack.h)."""

    type_name: str
    data: torch.Tensor
    cols: int
    repacked: bool = False

    @property
    def type_number(self) -> int:
        """The GGML type number the native ops take (+100: the 16-row form)."""
        return BLOCKS[self.type_name][0] + (100 if self.repacked else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.data.shape[0]), self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def permute_rows(self, order: torch.Tensor) -> GGUFMatrix:  # order [N]: new row i = old row order[i]
        if self.repacked:
            raise ValueError("permute_rows: a repacked matrix's rows are interleaved in groups of 16")
        return GGUFMatrix(self.type_name, self.data[order], self.cols)


def repackable(m: GGUFMatrix) -> bool:
    """Whether `m` has a 16-row form (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; rows a multiple of 16), not yet in it."""
    return not m.repacked and m.type_name in REPACKED_TYPES and m.shape[0] % REPACK_ROWS == 0 and m.shape[0] > 0


def repacks_on(kind: CpuKind, type_name: str) -> bool:
    """Whether the `gguf_repack` rule puts `type_name`'s matrices into 16-row groups on a CPU of `kind`."""
    return type_name in REPACKED_TYPES and default_choice("gguf_repack", DECODE, type_name, kind, REPACK_FORMS) == "x16"


def repack(m: GGUFMatrix, ops: object) -> GGUFMatrix:
    """`m` in the 16-row form (kernels/csrc/gguf_x16.cpp), its file blocks' values bit for bit."""
    data = ops.gguf_repack16(m.data.contiguous(), BLOCKS[m.type_name][0])  # type: ignore[attr-defined]
    return GGUFMatrix(m.type_name, data, m.cols, repacked=True)


def dequantize(
    m: GGUFMatrix,
    ops: object | None,
    dtype: torch.dtype,
    ids: torch.Tensor | None = None,
    rows: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of `m` as floats in `dtype`: `ids` [R] (int64), or the range `rows` (start, end), or all;
    into `out` [R, cols] when given. The values are `gguf.quants.dequantize`'s (float32, then rounded to
    `dtype` as torch rounds)."""
    start, end = rows or (0, m.shape[0])
    count = ids.numel() if ids is not None else end - start
    if out is None:
        out = torch.empty(count, m.cols, dtype=dtype)
    if ops is not None and dtype in NATIVE_DTYPES:
        ops.gguf_dequant(out, m.data, m.type_number, ids, start)  # type: ignore[attr-defined]
        return out
    if m.repacked:
        raise ValueError(f"dequantize: a repacked {m.type_name} matrix needs the native kernels, float32 or bfloat16")
    import gguf

    picked = m.data[ids] if ids is not None else m.data[start:end]
    values = gguf.quants.dequantize(picked.numpy(), gguf.GGMLQuantizationType[m.type_name])
    out.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(count, m.cols))
    return out


def module_matrices(module: nn.Module) -> list[GGUFMatrix]:
    """The GGUF matrices a module holds: a `GGUFBlocksMethod` layer's parts, a `GGUFEmbedding`'s table."""
    if isinstance(module, GGUFEmbedding):
        return [module.matrix] if module.matrix is not None else []
    return [m for _, m in getattr(module, "gguf_parts", [])]


def held_matrices(modules: Iterable[nn.Module]) -> list[GGUFMatrix]:
    """The GGUF matrices the modules hold, each buffer once (a tied table and its head share one)."""
    seen: dict[int, GGUFMatrix] = {}
    for module in modules:
        for m in module_matrices(module):
            seen.setdefault(m.data.data_ptr(), m)
    return list(seen.values())


class GGUFBlocksMethod(LinearMethod):
    """Each layer's matrices as their GGUF blocks (`layer.gguf_parts`: (first output column, matrix) per
    run of shards of one type); products by the native kernels (few rows: `gguf_linear`, more:
    `gguf_gemm`), or without them dequantized chunks and torch's GEMM."""

    name = "gguf"
    prequantized = True  # the loader hands its layers their checkpoint tensors as stored
    keeps_blocks = True  # ... as `GGUFMatrix` blocks (not tokenmill's int formats)
    types = BLOCK_TYPES

    def __init__(
        self,
        kernels: CpuKernels | None,
        max_native_rows: int = MAX_NATIVE_ROWS,
        prompt_kernel: str = "auto",
        cpu: CpuKind | None = None,
        repack: bool | None = None,
    ) -> None:
        if prompt_kernel not in PROMPT_KERNELS:
            raise ValueError(f"prompt_kernel: expected one of {', '.join(PROMPT_KERNELS)}, got {prompt_kernel!r}")
        self.ops = kernels.ops if kernels is not None else None
        self.max_native_rows = max_native_rows
        # more rows: "gemm" (`gguf_gemm`), "widened" (`gguf_gemm_widened`), "dequant" (chunks + torch's
        # GEMM), or "auto": each block type's default for this CPU kind (kernels/defaults.py)
        self.prompt_kernel = prompt_kernel
        kind = cpu or CpuKind.from_flags(cpu_flags())
        self.type_prompt = {t: default_choice("gguf_prompt", PROMPT, t, kind, PROMPT_KERNELS[1:]) for t in BLOCKS}
        # the REPACKED_TYPES put into 16-row groups at load: those the CPU kind's rule prefers so
        # (kernels/defaults.py `gguf_repack`), unless told (True: all of them; False: none)
        if repack is None:
            self.repack_types = frozenset(t for t in REPACKED_TYPES if repacks_on(kind, t))
        else:
            self.repack_types = frozenset(REPACKED_TYPES if repack else ())
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # reused by prompt products (one at a time)

    def create_weights(
        self, layer: Layer, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        layer.gguf_pieces = wait_for_pieces(layer, input_size, GGUFMatrix)
        layer.gguf_dtype = dtype
        if bias:
            register_bias(layer, dtype)

    def process_weights_after_loading(self, layer: Layer) -> None:
        """The shards in output order, neighbours of one type joined into one matrix."""
        parts: list[tuple[int, GGUFMatrix]] = []
        runs: list[list[GGUFMatrix]] = []
        for sid in layer.shards:  # (in output order)
            piece = layer.gguf_pieces[sid]
            if runs and runs[-1][0].type_name == piece.type_name:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        start = 0
        native = self.ops is not None and layer.gguf_dtype in NATIVE_DTYPES
        for run in runs:
            data = run[0].data if len(run) == 1 else torch.cat([p.data for p in run])
            matrix = GGUFMatrix(run[0].type_name, data, layer.input_size)
            if native and self.repacks(matrix):
                matrix = repack(matrix, self.ops)
            parts.append((start, matrix))
            start += int(data.shape[0])
        layer.gguf_parts = parts
        del layer.gguf_pieces, layer.weight

    def repacks(self, m: GGUFMatrix) -> bool:
        """Whether `m` is put into 16-row groups at load (its type chosen, its rows allowing)."""
        return m.type_name in self.repack_types and repackable(m)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], layer.output_size, dtype=x.dtype)  # [M, out]
        for start, m in layer.gguf_parts:
            cols = out[:, start : start + m.shape[0]]
            product = self.product(m.type_name, rows, m.repacked)
            if product is not None:
                getattr(self.ops, product)(cols, rows, m.data, m.type_number)
            else:
                self._dequant_product(m, rows, cols)
        if bias is not None:
            out += bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], layer.output_size)

    def product(self, type_name: str, rows: torch.Tensor, repacked: bool = False) -> str | None:
        """The native op for `rows` [M, K] against a matrix of `type_name`, or None: dequantized chunks.
        A repacked matrix's one product serves every row count (`gguf_gemm` takes it to gguf_x16.cpp)."""
        if self.ops is None or rows.dtype not in NATIVE_DTYPES:
            return None
        if rows.shape[0] <= self.max_native_rows:
            return "gguf_linear"
        if repacked and self.prompt_kernel == "auto":
            return "gguf_gemm"
        kernel = self.type_prompt[type_name] if self.prompt_kernel == "auto" else self.prompt_kernel
        return {"gemm": "gguf_gemm", "widened": "gguf_gemm_widened"}.get(kernel)

    # --- the fused decode (decode_layer.cpp's GGUF kind: a layer of one run, or two of different types) ---
    def fusable(self, layer: Layer) -> bool:
        return self.ops is not None and layer.gguf_dtype in NATIVE_DTYPES and len(layer.gguf_parts) <= 2

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        return FusedKind.GGUF if rows <= self.max_native_rows else None

    def fused_tensors(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """(first run's blocks, int64 [type 0, type 1 (-1: none), first run's rows], second run's blocks
        or None, 0)"""
        (_, first), *rest = layer.gguf_parts
        second = rest[0][1] if rest else None
        kinds = [first.type_number, second.type_number if second else -1, first.shape[0]]
        return first.data, torch.tensor(kinds, dtype=torch.int64), second.data if second else None, 0

    def map_held(self, layer: Layer, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if hasattr(layer, "gguf_parts"):
            layer.gguf_parts = [(start, map_tensors(m, fn)) for start, m in layer.gguf_parts]

    def _dequant_product(self, m: GGUFMatrix, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """cols [M, n] = rows [M, K] @ W^T, W dequantized a chunk of its rows at a time into the scratch."""
        n, k = m.shape
        chunk = max(1, min(n, SCRATCH_VALUES // k))
        scratch = self._scratch.get(rows.dtype)
        if scratch is None or scratch.numel() < chunk * k:
            scratch = self._scratch[rows.dtype] = torch.empty(max(chunk * k, SCRATCH_VALUES), dtype=rows.dtype)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            w = dequantize(m, self.ops, rows.dtype, rows=(r0, r1), out=scratch[: (r1 - r0) * k].view(r1 - r0, k))
            cols[:, r0:r1] = F.linear(rows, w)

    def rows(self, layer: Layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # ids [T] -> [T, in]
        """Rows `ids` of the layer's weights, dequantized (a tied embedding table read from its head)."""
        (_, m), *more = layer.gguf_parts
        if more:
            raise ValueError("rows: a layer of several GGUF matrices")
        return dequantize(m, self.ops, dtype, ids=ids.reshape(-1)).view(*ids.shape, m.cols)


class GGUFEmbedding(nn.Module):
    """An embedding table kept in its GGUF blocks: each looked-up row dequantized. Its `weight` is a
    placeholder whose loader takes the table's `GGUFMatrix`; a tied output projection of
    `GGUFBlocksMethod` gets the same matrix (`share_with`), one copy for both."""

    def __init__(self, vocab: int, hidden: int, method: GGUFBlocksMethod, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = (vocab, hidden)
        self.method = method
        self.dtype = dtype
        self.matrix: GGUFMatrix | None = None
        placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
        self.register_parameter("weight", set_weight_loader(placeholder, self._load))

    def _load(self, param: nn.Parameter, loaded: object, shard_id: ShardId) -> None:
        if shard_id is not None:
            raise WeightLoadError(f"shard {shard_id!r} sent to an unfused parameter")
        if not isinstance(loaded, GGUFMatrix):
            raise WeightLoadError(f"expected GGUF blocks, got {type(loaded).__name__}")
        if loaded.shape != self.shape:
            raise WeightShapeError(loaded.shape, self.shape, None)
        self.matrix = loaded

    def finish_loading(self, tied_head: nn.Module | None = None) -> None:
        """Drop the placeholder once the table is in; a tied head's matrix (one part of the table's shape:
        the same blocks, perhaps repacked at load) becomes the table, so that one copy is held."""
        if "weight" in self._parameters:
            del self.weight
        parts = getattr(tied_head, "gguf_parts", [])
        if len(parts) == 1 and parts[0][1].shape == self.shape:
            self.matrix = parts[0][1]

    def blocks(self) -> GGUFMatrix | None:
        """The table's blocks, as the native decode run looks rows up in (as `HeadRows.blocks`)."""
        return self.matrix

    def map_held_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The table's blocks replaced by fn(blocks) (runner/huge_pages.py)."""
        self.matrix = map_tensors(self.matrix, fn)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        assert self.matrix is not None, "GGUFEmbedding used before its table was loaded"
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        return dequantize(self.matrix, self.method.ops, self.dtype, ids=flat).view(*ids.shape, self.shape[1])
