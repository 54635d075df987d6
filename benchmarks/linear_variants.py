"""Side-by-side timings of variants of the linear kernel, for tuning it on the CPU at hand.

A shared machine's timings drift from one minute to the next by more than the variants differ, so two
builds timed in two runs cannot be compared. This script builds each variant of
`tokenmill/kernels/csrc/linear.cpp` (other compile flags, or another copy of the source) into its own op
namespace (`-DTM_LIB=...`), loads them all into one process, and times them interleaved on the peer
model's linear layers (8 layers' worth of distinct weights plus the output projection, so they come
from memory as in a step), median of 9. `--shapes mid`: the 1.1B peer model's (TinyLlama-1.1B's) layers
instead, 4 layers' worth; `--huge-pages`: the weights on 2 MB pages, where tokenmill keeps them
(runner/huge_pages.py), not torch's 4 KB-page allocations.

Usage:
  python benchmarks/linear_variants.py '{"now": [], "pf2": ["-DSOME_FLAG=2"], "old": ["src=/tmp/old/linear.cpp"]}' \\
      --rows 1,4,16 --dtypes float32,bfloat16 [--shapes small|mid] [--huge-pages] [--torch] [--out FILE]
(a flag `src=PATH` takes the source from PATH; its folder must hold convert.h and ops.h as csrc/ does)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenmill.kernels.cpu_build import compile_flags
from tokenmill.runner import huge_pages

CSRC = Path(__file__).resolve().parent.parent / "tokenmill" / "kernels" / "csrc"
# per model: a layer's (qkv, o, gate_up, down) shapes [N, K], the output projection's, layers' worth timed
MODELS = {
    "small": (((768, 512), (512, 512), (2752, 512), (512, 1376)), (32000, 512), 8),  # the 55M peer model
    "mid": (((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)), (32000, 2048), 4),  # the 1.1B one
}


def build(name: str, flags: list[str]) -> object:
    source = Path(next((f[4:] for f in flags if f.startswith("src=")), CSRC / "linear.cpp"))
    cflags = [*compile_flags(), f"-DTM_LIB=tmv_{name}", *(f for f in flags if not f.startswith("src="))]
    key = hashlib.sha256((source.read_text() + " ".join(cflags)).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"tokenmill-linear-{name}-{key}"
    folder.mkdir(exist_ok=True)
    cpp_extension.load(
        name=f"tmv_{name}",
        sources=[str(source)],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(source.parent)],
        build_directory=str(folder),
        is_python_module=False,
    )
    return getattr(torch.ops, f"tmv_{name}")


def make_weights(shapes: list[tuple[int, int]], dtype: torch.dtype, huge: bool) -> list[torch.Tensor]:
    """Random weights of `shapes`, each on 2 MB pages where `huge` (and Linux allows them)."""
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k).to(dtype)
        if huge and huge_pages.available():
            w = huge_pages.huge_zeros((n, k), dtype).copy_(w)
        weights.append(w)
    return weights


def stack(
    ops: object, weights: list[torch.Tensor], outs: list[torch.Tensor], inputs: dict[int, torch.Tensor]
) -> Callable[[], None]:
    """Every weight once through one variant's op."""

    def go() -> None:
        for w, out in zip(weights, outs, strict=True):
            ops.linear(out, inputs[w.shape[1]], w, None)  # type: ignore[attr-defined]

    return go


def torch_stack(
    weights: list[torch.Tensor], outs: list[torch.Tensor], inputs: dict[int, torch.Tensor]
) -> Callable[[], None]:
    """Every weight once through torch's own linear (MKL / oneDNN), for reference."""

    def go() -> None:
        for w, out in zip(weights, outs, strict=True):
            torch.nn.functional.linear(inputs[w.shape[1]], w, out=out)

    return go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", help='JSON: {"name": [compile flags or "src=PATH"], ...}')
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", choices=sorted(MODELS), default="small", help="the 55M or 1.1B model's layers")
    parser.add_argument("--huge-pages", action="store_true", help="the weights on 2 MB pages, as tokenmill holds them")
    parser.add_argument("--torch", action="store_true", help="time torch.nn.functional.linear beside them")
    parser.add_argument("--out", default=None, help="write the medians here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {name: build(name, flags) for name, flags in json.loads(args.variants).items()}
    shapes, head, layers = MODELS[args.shapes]
    result: dict[str, dict[str, dict[str, float]]] = {}  # dtype -> rows -> variant -> ms
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        weights = make_weights([*(s for _ in range(layers) for s in shapes), head], dtype, args.huge_pages)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(m, k).to(dtype) for k in {w.shape[1] for w in weights}}
            outs = [torch.empty(m, w.shape[0], dtype=dtype) for w in weights]

            fns = {name: stack(ops, weights, outs, inputs) for name, ops in variants.items()}
            if args.torch:
                fns["torch"] = torch_stack(weights, outs, inputs)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(9):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            result.setdefault(dtype_name, {})[str(m)] = medians
            print(
                f"{dtype_name:8} rows {m:2}: "
                + " | ".join(f"{n} {t:.2f} ms ({nbytes / t / 1e6:.0f} GB/s)" for n, t in medians.items()),
                flush=True,
            )
    if args.out:
        record = {
            "variants": json.loads(args.variants),
            "threads": args.threads,
            "torch_linear": args.torch,
            "weights": f"{layers} x {list(shapes)} + {list(head)}",
            "huge_pages": args.huge_pages and huge_pages.available(),
            "median_ms": result,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
