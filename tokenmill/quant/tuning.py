"""Kernel choice for the quantized linear methods: each method's kernels timed on the weights of each
shape, class of row counts by class (as the dense plan, quant/cpu_dense.py), through the autotune cache,
so the plan follows the CPU at hand; a start-up that does not measure takes kernels/defaults.py's rule
for the CPU kind and row class where the cache has no choice yet."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from tokenmill.kernels.autotune import Autotuner
from tokenmill.kernels.defaults import default_choice, row_class
from tokenmill.quant.cpu_dense import each_shape, tune_row_classes
from tokenmill.quant.int_methods import Kernel, QuantizedLinearMethod
from tokenmill.quant.method import Layer, Shape


def weights_by_shape(layers: Iterable[Layer]) -> dict[Shape, list[object]]:
    """The quantized weights of `layers`, grouped by (out, in), in order."""
    shapes: dict[Shape, list[object]] = {}
    for layer in layers:
        shapes.setdefault((layer.output_size, layer.input_size), []).append(layer.quantized)  # type: ignore[attr-defined]
    return shapes


def _over(kernel: Kernel, inputs: list[torch.Tensor], weights: Sequence[object]) -> Callable[[], None]:
    def run() -> None:
        for x in inputs:
            for w in weights:
                kernel(w, x, None)

    return run


def tune_quantized(
    method: QuantizedLinearMethod,
    shapes: dict[Shape, list[object]],
    max_rows: dict[Shape, int],
    dtype: torch.dtype,
    tuner: Autotuner,
) -> dict[str, str]:
    """Fill `method.plan` from timings of each of its kernels for `dtype` activations on the weights of
    each shape, class by class (`tune_row_classes`, as the dense plan). Returns a summary for the log."""
    kernels = method.kernels(dtype)

    def choose(shape: Shape, timed: Sequence[object], low: int, high: int, ends: list[int]) -> str:
        inputs = [torch.randn(m, shape[1]).to(dtype) for m in ends]
        group = getattr(timed[0], "group", shape[1])
        what = (
            f"{method.name} g{group} {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} "
            f"rows {low}-{high} at {ends} x{len(timed)}"
        )
        allowed = {name: k for name, k in kernels.items() if high <= method.row_limits.get(name, high)}
        candidates = {name: _over(k, inputs, timed) for name, k in (allowed or kernels).items()}
        default = default_choice(method.name, row_class(low), str(dtype).removeprefix("torch."), tuner.cpu, candidates)
        return tuner.choose("quant_linear", what, candidates, default=default).name

    plans, summary = tune_row_classes(shapes, max_rows, each_shape(choose))
    method.plan.update(plans)
    return summary
