"""What `torch.compile` would give tokenmill's decode step on this CPU, before the engine compiles it.

The peer model (shared/PEERS.md, or the `small` model) decodes with tokenmill's default kernels
(native attention, layer ops and linear method, tuned as the engine tunes them), eagerly and through
`torch.compile` (inductor, C++ code for the whole step around the native ops, which get fake
implementations for tracing), at each batch size in turn: the first compiled call's time (the
compile) and the step time of both, median of interleaved repeats after a 128-token prefill each.
Batch sizes change the graph (the linear plan branches on the row count), so each is compiled anew:
what an engine would pay per padded batch size.

Usage: python benchmarks/compile_probe.py [--model DIR] [--dtype bfloat16] [--batches 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, ensure_model
from forward import Tokenmill

from tokenmill.bench.metrics import spread
from tokenmill.kernels.cpu_build import cpu_flags, load_cpu_kernels

CUSTOM_OPS = ("linear", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "write_kv", "paged_attention")
STEPS = 12


def register_fakes() -> None:
    """Every native op writes into tensors it is given and returns nothing: tracing needs no more."""
    for name in CUSTOM_OPS:
        torch.library.register_fake(f"tokenmill_cpu::{name}")(lambda *args, **kwargs: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the small peer model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "compile_probe.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    if load_cpu_kernels() is None:
        raise SystemExit("the native kernels did not build here")
    register_fakes()
    folder = Path(args.model) if args.model else ensure_model()
    tm = Tokenmill(folder, getattr(torch, args.dtype), fused=False)  # the modules: what compile would trace
    model = tm.model
    eager = model.forward
    compiled = torch.compile(eager, dynamic=False)
    rows: dict[str, object] = {}
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            setup, step = tm.decode(torch.randint(0, model.config.vocab_size, (b, 128)))
            setup()
            model.forward = compiled
            start = time.perf_counter()
            step()
            compile_s = time.perf_counter() - start
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for name, fn in (("eager", eager), ("compiled", compiled)):
                    model.forward = eager
                    setup()
                    model.forward = fn
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        step()
                    times[name].append((time.perf_counter() - start) / STEPS * 1e3)
            model.forward = eager
            ratio = [e / c for e, c in zip(times["eager"], times["compiled"], strict=True)]
            rows[str(b)] = {
                "compile_s": compile_s,
                "eager_step_ms": spread(times["eager"]),
                "compiled_step_ms": spread(times["compiled"]),
                "speedup": spread(ratio),
            }
            print(
                f"batch {b:3}: compile {compile_s:5.1f} s, step eager {statistics.median(times['eager']):.2f} ms, "
                f"compiled {statistics.median(times['compiled']):.2f} ms ({statistics.median(ratio):.2f}x "
                f"[{min(ratio):.2f}-{max(ratio):.2f}])",
                flush=True,
            )
    result = {
        "model": str(folder),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "avx512": "avx512f" in cpu_flags().split(),
        "repeats": args.repeats,
        "batches": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
