"""Whether torchao's quantized layers are worth using on this CPU: its int8 weight-only, dynamic
int8 (W8A8) and int4 weight-only configs on the peer model's linear layers, beside the dense bfloat16
layers they replace, at 1, 4 and 32 rows (bfloat16 activations; median of 30 calls, each every layer
once). torchao is not one of the project's dependencies: install the release made for torch 2.13
somewhere apart and put it on the path, e.g.

  .venv/bin/pip install --no-deps --target /tmp/torchao torchao==0.18.0
  PYTHONPATH=/tmp/torchao .venv/bin/python benchmarks/torchao_probe.py

A config that fails is recorded with its error. Writes benchmarks/results/torchao_probe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import RESULTS

SHAPES = ((768, 512), (512, 512), (2752, 512), (512, 1376))  # the peer model's qkv, o, gate_up, down
HEAD = (32000, 512)
LAYERS = 8
ROWS = (1, 4, 32)


class Stack(torch.nn.Module):
    """The peer model's linear layers, each applied to the first `in_features` columns of x."""

    def __init__(self) -> None:
        super().__init__()
        dims = [s for _ in range(LAYERS) for s in SHAPES] + [HEAD]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False) for n, k in dims)

    def forward(self, x: torch.Tensor) -> None:
        for layer in self.layers:
            layer(x[..., : layer.in_features])


def median_ms(model: torch.nn.Module, x: torch.Tensor, calls: int = 30) -> float:
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "torchao_probe.json"))
    args = parser.parse_args()
    import torchao
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    from torchao.quantization import quantize_ as quantize

    torch.manual_seed(0)
    inputs = {m: torch.randn(m, 1376).bfloat16() for m in ROWS}
    configs: dict[str, Callable[[], Any] | None] = {
        "dense_bf16": None,
        "Int8WeightOnlyConfig": Int8WeightOnlyConfig,
        "Int8DynamicActivationInt8WeightConfig": Int8DynamicActivationInt8WeightConfig,
    }
    # every int4 packing format this release has (their names differ between releases)
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    for fmt in Int4PackingFormat:
        configs[f"Int4WeightOnlyConfig(group_size=32, {fmt.value})"] = lambda fmt=fmt: Int4WeightOnlyConfig(
            group_size=32, int4_packing_format=fmt
        )
    result: dict[str, Any] = {"torch": torch.__version__, "torchao": torchao.__version__, "rows": ROWS, "ms": {}}
    for name, make in configs.items():
        model = Stack().bfloat16()
        try:
            if make is not None:
                quantize(model, make())
            result["ms"][name] = {m: round(median_ms(model, x), 3) for m, x in inputs.items()}
        except Exception as exc:  # a config this CPU or release cannot run: recorded, not fatal
            result["ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        print(name, result["ms"][name], flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
