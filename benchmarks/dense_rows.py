"""The dense few-row products at a real model's sizes (issue 44: the 1.1B model in bfloat16 at 8
requests), beside the machine's floors, for builds of the native linear kernel side by side.

Each variant of `tokenmill/kernels/csrc/linear.cpp` is built into its own op namespace
(benchmarks/linear_variants.py `build`) and loaded into one process; all are timed interleaved, one
repeat after another, on random weights of the model's shapes (TinyLlama-1.1B by default: qkv
2560x2048, o 2048x2048, gate_up 11264x2048, down 2048x5632, head 32000x2048; `--layers` layers of
distinct weights so they come from memory as in a step):

- `shapes`: each shape's layers back to back, at each row count;
- `step`: every weight once in layer order, then the head (a decode step's products);
- `floors`: the step's weight bytes over the streaming bandwidth measured in the same repeat
  (torch.sum over 1 GiB of float32, benchmarks/bandwidth.py's reader) and its FMAs over the FMA
  peak the CPU's clock says (2 cores x 2 FMA pipes x 8 float32 lanes x 2 flops a cycle at the
  /proc/cpuinfo MHz), and the kernel's own rate on a weight that stays in L2 (no memory in it);
- `model` (with --model DIR): one whole decode step of that model folder on the native paths
  (`cpu` attention and layer ops, modules not fused; weights on 2 MB pages as a server places them,
  or `--pages small`), at each of --batches, with its time split into
  the products, attention and the rest (benchmarks/decode_step.py), each variant's op swapped in.

Medians of --repeats interleaved repeats with [min-max], and each variant's time over the first
variant's per repeat (the ratio's median and spread). The CPU is named in the JSON.

Usage: python benchmarks/dense_rows.py '{"before": ["-DTM_KBLOCK_MIN=9"], "kblock": []}' \\
    [--rows 1,2,4,8,9,16] [--model /tmp/peers/mid-llama] [--batches 1,8] [--out results/dense_rows.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from linear_variants import build

from tokenmill.bench.metrics import spread
from tokenmill.kernels.cpu_build import cpu_flags
from tokenmill.runner.huge_pages import huge_zeros

RESULTS = Path(__file__).resolve().parent / "results"
Fn = Callable[[], None]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_mhz() -> float:
    mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines() if "cpu MHz" in line]
    return max(mhz) if mhz else 0.0


def model_shapes(hidden: int, inter: int, heads: int, kv_heads: int, vocab: int) -> dict[str, tuple[int, int]]:
    head_dim = hidden // heads
    return {
        "qkv": (hidden + 2 * kv_heads * head_dim, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "head": (vocab, hidden),
    }


def over(op: Any, weights: list[torch.Tensor], xs: dict[int, torch.Tensor], outs: list[torch.Tensor]) -> Fn:
    def go() -> None:
        for w, out in zip(weights, outs, strict=True):
            op(out, xs[w.shape[1]], w, None)

    return go


def bandwidth_gb_s(buffer: torch.Tensor) -> float:
    t = time.perf_counter()
    buffer.sum()
    return buffer.numel() * 4 / (time.perf_counter() - t) / 1e9


def interleave(fns: dict[str, Fn], repeats: int, before: Fn | None = None) -> dict[str, list[float]]:
    """ms per call of each fn, `repeats` rounds of one call each in turn (after one untimed call each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        if before:
            before()
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    first = next(iter(times))
    out: dict[str, Any] = {name: spread(t) for name, t in times.items()}
    base = times[first]
    out["over_" + first] = {
        name: spread([a / b for a, b in zip(t, base, strict=True)]) for name, t in times.items() if name != first
    }
    return out


def weight(shape: tuple[int, int], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """Random weights, on 2 MB pages where `huge` (as a server places them: runner/huge_pages.py)."""
    w = torch.randn(*shape).to(dtype)
    return huge_zeros(w.shape, dtype).copy_(w) if huge else w


def products(args: argparse.Namespace, ops: dict[str, Any]) -> dict[str, Any]:
    """The `shapes`, `step` and `floors` sections at each row count."""
    dtype = getattr(torch, args.dtype)
    shapes = model_shapes(args.hidden, args.inter, args.heads, args.kv_heads, args.vocab)
    huge = args.pages == "huge"
    layers = {n: [weight(s, dtype, huge) for _ in range(args.layers)] for n, s in shapes.items() if n != "head"}
    head = weight(shapes["head"], dtype, huge)
    step = [layers[name][i] for i in range(args.layers) for name in layers] + [head]
    step_bytes = sum(w.numel() * w.element_size() for w in step)
    hot = torch.randn(128, args.hidden).to(dtype)  # 512 KB in bfloat16: half in each core's L2
    buffer = torch.ones(1 << 28)  # 1 GiB of float32
    peak = 2 * 2 * 8 * 2 * cpu_mhz() * 1e6 * args.threads / 2 / 1e9  # GFLOP/s
    result: dict[str, Any] = {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dtype) for k in (args.hidden, args.inter)}
        entry: dict[str, Any] = {"shapes": {}}
        for name, ws in [*layers.items(), ("head", [head])]:
            outs = [torch.empty(m, w.shape[0], dtype=dtype) for w in ws]
            fns = {v: over(op, ws, xs, outs) for v, op in ops.items()}
            entry["shapes"][f"{name} {ws[0].shape[0]}x{ws[0].shape[1]} x{len(ws)}"] = summary(
                interleave(fns, args.repeats)
            )
        outs = [torch.empty(m, w.shape[0], dtype=dtype) for w in step]
        bw: list[float] = []
        read = lambda bw=bw: bw.append(bandwidth_gb_s(buffer))  # noqa: E731 (once a repeat)
        times = interleave({v: over(op, step, xs, outs) for v, op in ops.items()}, args.repeats, read)
        entry["step"] = summary(times)
        flops = 2 * m * sum(w.numel() for w in step)
        entry["floors"] = {
            "weight_bytes": step_bytes,
            "bandwidth_gb_s": spread(bw),
            "bandwidth_floor_ms": step_bytes / statistics.median(bw) / 1e6,
            "fma_peak_gflop_s": peak,
            "fma_floor_ms": flops / peak / 1e6,
            "gflop_s": {v: flops / statistics.median(t) / 1e6 for v, t in times.items()},
        }
        hot_out = torch.empty(m, 128, dtype=dtype)
        reps = 200
        hot_fns = {v: over(op, [hot] * reps, xs, [hot_out] * reps) for v, op in ops.items()}
        hot_times = interleave(hot_fns, args.repeats)
        entry["floors"]["in_l2_gflop_s"] = {
            v: 2 * m * hot.numel() * reps / statistics.median(t) / 1e6 for v, t in hot_times.items()
        }
        result[str(m)] = entry
        line = " | ".join(f"{v} {entry['step'][v]['median']:.1f} ms" for v in ops)
        fl = entry["floors"]
        print(
            f"rows {m:2} step: {line} (floors: bytes {fl['bandwidth_floor_ms']:.1f} ms,"
            f" FMA {fl['fma_floor_ms']:.1f} ms;"
            f" in L2 {', '.join(f'{v} {g:.0f}' for v, g in fl['in_l2_gflop_s'].items())} GFLOP/s)",
            flush=True,
        )
        for shape, s in entry["shapes"].items():
            print(f"    {shape:28} " + " | ".join(f"{v} {s[v]['median']:.2f}" for v in ops), flush=True)
    return result


def whole_step(args: argparse.Namespace, ops: dict[str, Any]) -> dict[str, Any]:
    """One decode step of --model on the native paths at each of --batches, per variant (the dense
    method's op swapped), interleaved; time split as decode_step.py does."""
    from decode_step import Decoder, time_split

    from tokenmill.kernels.cpu_build import CpuKernels
    from tokenmill.layers.backends import get_attention_backend
    from tokenmill.layers.ops import get_layer_ops
    from tokenmill.models.loader import load_model
    from tokenmill.quant.cpu_dense import CpuLinearMethod
    from tokenmill.runner.huge_pages import place_on_huge_pages

    method = CpuLinearMethod(CpuKernels(ops=next(iter(ops.values())), build_dir=Path()))
    decoder = Decoder.__new__(Decoder)  # (its own constructor loads the model without this method)
    decoder.backend = get_attention_backend("cpu")
    decoder.dtype = getattr(torch, args.dtype)
    decoder.model = load_model(
        args.model,
        dtype=decoder.dtype,
        backend=decoder.backend,
        linear_method=method,
        head_method=method,
        ops=get_layer_ops("cpu"),
        place=place_on_huge_pages if args.pages == "huge" else None,
    )
    result: dict[str, Any] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        splits: dict[str, list[dict[str, float]]] = {v: [] for v in ops}
        for _ in range(args.repeats):
            for v, op in ops.items():
                method._linear = op.linear.default
                splits[v].append(time_split(decoder, [args.context] * batch, args.steps))
        times = {v: [s["total"] for s in splits[v]] for v in ops}
        entry = summary(times)
        entry["split_ms"] = {v: {k: spread([s[k] for s in splits[v]]) for k in splits[v][0]} for v in ops}
        result[str(batch)] = entry
        print(
            f"model step, batch {batch}: "
            + " | ".join(
                f"{v} {entry[v]['median']:.1f} ms (products {entry['split_ms'][v]['matrices']['median']:.1f})"
                for v in ops
            ),
            flush=True,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", help='JSON: {"name": [compile flags or "src=PATH"], ...}; the first is the base')
    parser.add_argument("--rows", default="1,2,4,8,9,16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--model", help="a model folder for whole decode steps (e.g. /tmp/peers/mid-llama)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument(
        "--pages", choices=("huge", "small"), default="huge", help="weights on 2 MB pages (a server's default) or 4 KB"
    )
    parser.add_argument("--out", default=str(RESULTS / "dense_rows.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    variants = json.loads(args.variants)
    ops = {name: build(name, flags) for name, flags in variants.items()}
    record: dict[str, Any] = {
        "benchmark": "dense_rows",
        "cpu": cpu_name(),
        "simd": [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags().split()],
        "cpu_mhz": cpu_mhz(),
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "layers": args.layers,
        "pages": args.pages,
        "variants": variants,
        "shapes": model_shapes(args.hidden, args.inter, args.heads, args.kv_heads, args.vocab),
    }
    with torch.inference_mode():
        if not args.skip_products:
            record["rows"] = products(args, {name: op.linear for name, op in ops.items()})
        if args.model:
            record["model"] = str(args.model)
            record["model_step"] = whole_step(args, ops)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
