"""Dense linear layers on the CPU: the native few-row kernel or torch's GEMM, chosen per weight shape
and class of row counts by measurement on the CPU at hand (`tokenmill tune`; until then, and on every
server start, the autotune cache's choice or kernels/defaults.py's rule for the CPU kind).

`CpuLinearMethod` holds the same dense weight as `UnquantizedLinearMethod` (the checkpoint's
[out, in] layout, nothing repacked) and applies it through `product`: the native kernel
(`kernels/csrc/linear.cpp`: weights streamed once, vector FMA or AVX-512 BF16 dot products) for
decode batches and prompt chunks, or torch's `F.linear` (MKL / oneDNN). Which is faster depends on the
CPU, the dtype, the shape and the row count (on one AVX-512 machine torch's float32 product at 2-8
rows costs twice its single row; on an AVX2 machine torch's bfloat16 GEMM runs at a fifth of the
native kernel's speed even on prompt chunks, while its float32 GEMM is faster than the native kernel
there), so `tune_linear` times both on the model's own weights for each row class in `ROW_CLASSES`
(decode classes inside a pass over the whole step's weights, prompt chunks shape by shape) through the
autotune cache (which, not measuring, answers a choice it lacks with the default), and the plan it
returns says, per (out, in) shape, which rows go native.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.autotune import Autotuner
from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels, choose, native_choices
from tokenmill.kernels.defaults import default_choice, row_class
from tokenmill.quant.method import FusedKind, Layer, Shape, UnquantizedLinearMethod

logger = logging.getLogger("tokenmill")

# Row counts timed apart: one row (a single decode), a few (2-8), a batch (9-24, 25-64: on the AMX
# machine the native float32 kernel wins at 16 rows and torch's GEMM at 32, so one 9-64 class, decided
# by the sum at 9 and 64, sent 16-row steps to the slower one), prompt chunks (65 and more); each class
# is timed at both of its ends (summed), capped at the rows the weight can see (the
# engine's max_num_batched_tokens; max_num_seqs for the output projection) and at LONGEST_TIMED. Row
# counts past the last class take its choice.
ROW_CLASSES = ((1, 1), (2, 8), (9, 24), (25, 64), (65, 512))
# Prompt chunks are arithmetic, not weight reads: timed at 65 and 256 rows, on the first PROMPT_WEIGHTS
# weights of a shape only (which weights come from memory no longer matters; this keeps a slow
# candidate, torch's emulated bfloat16 GEMM, to about a second of start-up). On the AVX2 machine
# torch's float32 GEMM wins this class by 10-70% and its bfloat16 GEMM loses it by 4-5x.
LONGEST_TIMED = 256
PROMPT_WEIGHTS = 2
MAX_DECODE_ROWS = 64  # the classes up to here are timed on every weight


class CpuLinearMethod(UnquantizedLinearMethod):
    """Dense weights on the CPU; `native[(out, in)][rows]` says whether `rows` input rows take the
    native kernel (row counts past the table: its last entry). A shape missing from the plan takes it
    at every row count (what `linear_backend="cpu"` pins)."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self._linear = kernels.ops.linear.default  # the overload itself: no lookup per call
        self.native: dict[Shape, tuple[bool, ...]] = {}

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = cast(torch.Tensor, layer.weight)
        if x.dim() == 2:  # [M, in]: the common case, no reshaping
            return self.product(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        return self.product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, shape: Shape | None = None
    ) -> torch.Tensor:  # x [M, in], weight [out, in] -> [M, out]
        """x @ weight^T (+ bias) by the kernel the plan gives `shape` (default: weight's own shape;
        a slice of a larger weight passes the whole weight's) at x's row count."""
        if self.takes_native(weight, x.shape[0], shape):
            return self.native_product(x, weight, bias)
        return F.linear(x, weight, bias)

    def takes_native(self, weight: torch.Tensor, rows: int, shape: Shape | None = None) -> bool:
        """Whether `rows` input rows against `weight` (planned as `shape`) take the native kernel."""
        if weight.dtype not in NATIVE_DTYPES:
            return False
        plan = self.native.get(shape or cast(Shape, weight.shape))  # torch.Size hashes as the tuple it is
        return plan is None or plan[min(rows, len(plan) - 1)]

    def fused_kind(self, layer: Layer, rows: int) -> int | None:
        return FusedKind.NATIVE if self.takes_native(cast(torch.Tensor, layer.weight), rows) else FusedKind.TORCH

    def native_product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)  # [M, out]
        self._linear(out, x, weight, bias)
        return out


def _over(
    fn: Callable[[torch.Tensor, torch.Tensor], object], inputs: list[torch.Tensor], weights: Sequence[torch.Tensor]
) -> Callable[[], None]:
    def run() -> None:
        for x in inputs:
            for w in weights:
                fn(x, w)

    return run


W = TypeVar("W")  # what a shape's weights are (dense tensors, or a quantized method's weights)
# (shape, the weights to time, the class's first and last row count, the row counts to time) -> kernel
ClassChooser = Callable[[Shape, Sequence[W], int, int, list[int]], str]
# the shapes of one row class, each with the weights to time and its row counts to time -> a kernel each
Members = dict[Shape, tuple[Sequence[W], list[int]]]
# (the class's members, its first and last row count) -> the kernel per member shape
ClassTuner = Callable[[Members[W], int, int], dict[Shape, str]]


def each_shape(choose: ClassChooser[W]) -> ClassTuner[W]:
    """A class tuner that times each shape on its own weights, apart from the others."""

    def tune(members: Members[W], low: int, high: int) -> dict[Shape, str]:
        return {shape: choose(shape, timed, low, high, ends) for shape, (timed, ends) in members.items()}

    return tune


def tune_row_classes(
    shapes: Mapping[Shape, Sequence[W]], max_rows: Mapping[Shape, int], tune: ClassTuner[W]
) -> tuple[dict[Shape, tuple[str, ...]], dict[str, str]]:
    """For each shape, the kernel `tune` names at each row class up to the shape's `max_rows`
    (default: the largest there), timed on every weight of the shape for decode classes (so they come
    from memory as in a step, not from cache) and on the first PROMPT_WEIGHTS for prompt chunks, at
    the class's two ends capped at LONGEST_TIMED. Returns per shape the kernel by row count (index 0,
    no rows: the first class's; rows past the table: its last entry), and a summary for the log."""
    picks: dict[Shape, list[str]] = {shape: [] for shape in shapes}
    summary: dict[str, str] = {}
    most = {shape: max_rows.get(shape, max(max_rows.values())) for shape in shapes}
    for low, high in ROW_CLASSES:
        members: Members[W] = {}
        for shape, weights in shapes.items():
            if low > most[shape] and picks[shape]:
                continue  # (rows this weight never sees)
            ends = sorted({min(low, most[shape], LONGEST_TIMED), min(high, most[shape], LONGEST_TIMED)})
            members[shape] = (weights if low <= MAX_DECODE_ROWS else weights[:PROMPT_WEIGHTS], ends)
        if not members:
            break
        for shape, pick in tune(members, low, high).items():
            picks[shape].append(pick)
            summary[f"{shape[0]}x{shape[1]} rows {low}-{high}"] = pick
    plans: dict[Shape, tuple[str, ...]] = {}
    for shape, chosen in picks.items():
        table = [chosen[0]]
        for (low, high), pick in zip(ROW_CLASSES, chosen, strict=False):
            table += [pick] * (min(high, most[shape]) - low + 1)
        plans[shape] = tuple(table)
    return plans, summary


def tune_linear(
    method: CpuLinearMethod, shapes: dict[Shape, list[torch.Tensor]], max_rows: dict[Shape, int], tuner: Autotuner
) -> dict[str, str]:
    """Fill `method.native` from timings of both kernels (`tune_row_classes`). Returns a summary for the log.

    Decode classes are timed inside a step: every weight of every shape in layer order, as a decode
    step streams them, one shape at a time on each kernel while the others keep the kernels chosen so
    far (native to begin with). Timed apart, a shape's 8 weights back to back on one kernel misjudge
    the step (the weights then sit in cache as they never do within a step, and the smaller projections
    were seen to land on the slower kernel). Prompt chunks (arithmetic, not weight reads) are
    timed shape by shape."""
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "cpu": method.native_product,
        "torch": F.linear,
    }

    def default(dtype: torch.dtype, low: int) -> str:  # without timing (kernels/defaults.py)
        return default_choice("linear", row_class(low), _name(dtype), tuner.cpu, kernels)

    def alone(shape: Shape, timed: Sequence[torch.Tensor], low: int, high: int, ends: list[int]) -> str:
        dtype = timed[0].dtype
        inputs = [torch.randn(m, shape[1]).to(dtype) for m in ends]
        what = f"{shape[0]}x{shape[1]} {_name(dtype)} rows {low}-{high} at {ends} x{len(timed)}"
        candidates = {name: _over(kernel, inputs, timed) for name, kernel in kernels.items()}
        return tuner.choose("linear", what, candidates, default=default(dtype, low)).name

    def in_step(members: Members[torch.Tensor], low: int, high: int) -> dict[Shape, str]:
        if low > MAX_DECODE_ROWS:
            return each_shape(alone)(members, low, high)
        dtype = next(iter(members.values()))[0][0].dtype
        inputs = {shape: [torch.randn(m, shape[1]).to(dtype) for m in ends] for shape, (_, ends) in members.items()}
        step = ", ".join(f"{s[0]}x{s[1]} at {ends} x{len(timed)}" for s, (timed, ends) in members.items())
        picks = dict.fromkeys(members, "cpu")
        for shape in members:  # (the others' kernels so far follow from the earlier choices: not in the key)
            what = f"{shape[0]}x{shape[1]} {_name(dtype)} rows {low}-{high} in a step of [{step}]"
            candidates = {name: _step_pass(members, inputs, {**picks, shape: name}, kernels) for name in kernels}
            picks[shape] = tuner.choose("linear_step", what, candidates, default=default(dtype, low)).name
        return picks

    plans, summary = tune_row_classes(shapes, max_rows, in_step)
    for shape, table in plans.items():
        method.native[shape] = tuple(name == "cpu" for name in table)
    return summary


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _step_pass(
    members: Members[torch.Tensor],
    inputs: dict[Shape, list[torch.Tensor]],
    picks: dict[Shape, str],
    kernels: Mapping[str, Callable[[torch.Tensor, torch.Tensor], object]],
) -> Callable[[], None]:
    """Every weight of `members` once at each of its row counts, layer by layer in the shapes' order
    (a decode step's reads), each shape on the kernel `picks` names."""
    depth = max(len(timed) for timed, _ in members.values())
    calls = [
        (kernels[picks[shape]], inputs[shape], timed[layer])
        for layer in range(depth)
        for shape, (timed, _) in members.items()
        if layer < len(timed)
    ]
    passes = max(len(ends) for _, ends in members.values())

    def run() -> None:
        for i in range(passes):
            for kernel, xs, weight in calls:
                kernel(xs[min(i, len(xs) - 1)], weight)

    return run


def dense_weight_shapes(model: nn.Module, tied_head: torch.Tensor | None) -> dict[Shape, list[torch.Tensor]]:
    """Every dense linear weight of `model` grouped by (out, in), in layer order, and a tied output
    projection (the embedding table) under its own shape."""
    shapes: dict[Shape, list[torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(getattr(module, "linear_method", None), UnquantizedLinearMethod):  # a dense linear layer
            weight = cast(torch.Tensor, module.weight)
            shapes.setdefault((weight.shape[0], weight.shape[1]), []).append(weight)
    if tied_head is not None:
        shapes.setdefault((tied_head.shape[0], tied_head.shape[1]), []).append(tied_head)
    return shapes


_METHODS: dict[str, Callable[[], UnquantizedLinearMethod]] = native_choices(
    "linear_backend", CpuLinearMethod, UnquantizedLinearMethod
)


def get_dense_linear_method(name: str) -> UnquantizedLinearMethod:
    """The dense linear method by name (`linear_backend`); a ValueError lists the names there are."""
    return choose("linear_backend", _METHODS, name)
