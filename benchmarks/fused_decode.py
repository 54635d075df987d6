"""The decode step with the decoder layers as one native call (`FusedDecode`) against the layers'
modules, on the same model object and cache contents, interleaved.

The `small` peer model (or --model), tokenmill's default kernels (native attention, layer ops and
linear kernel, tuned), decode at context 128 per sequence; per batch size, each repeat runs STEPS
steps with the fused layer and STEPS without, in alternating order. Prints step times and the ratio
(modules' time / fused time, per repeat); writes benchmarks/results/fused_decode.json.

Usage: python benchmarks/fused_decode.py [--repeats 5] [--batches 1,4,16] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from common import RESULTS, ensure_model
from forward import Tokenmill

from tokenmill.bench.metrics import spread

STEPS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the small peer model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "fused_decode.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = Path(args.model) if args.model else ensure_model()
    result: dict[str, object] = {
        "model": str(folder),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "steps": STEPS,
        "dtypes": {},
    }
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            tm = Tokenmill(folder, getattr(torch, dtype_name))
            fused = tm.model.fused_decode
            if fused is None:
                raise SystemExit("the fused decode layer does not apply here (native kernels unavailable?)")
            rows: dict[str, object] = {}
            for b in (int(x) for x in args.batches.split(",")):
                setup, step = tm.decode(torch.randint(0, tm.model.config.vocab_size, (b, 128)))
                times: dict[str, list[float]] = {"fused": [], "modules": []}
                for r in range(args.repeats):
                    order = ("fused", "modules") if r % 2 == 0 else ("modules", "fused")
                    for name in order:
                        tm.model.fused_decode = fused if name == "fused" else None
                        setup()
                        step()  # one untimed step
                        start = time.perf_counter()
                        for _ in range(STEPS):
                            step()
                        times[name].append((time.perf_counter() - start) / STEPS * 1e3)
                tm.model.fused_decode = fused
                ratio = [m / f for m, f in zip(times["modules"], times["fused"], strict=True)]
                rows[str(b)] = {
                    "fused_step_ms": spread(times["fused"]),
                    "modules_step_ms": spread(times["modules"]),
                    "speedup": spread(ratio),
                }
                fs, ms, rs = spread(times["fused"]), spread(times["modules"]), spread(ratio)
                print(
                    f"{dtype_name} batch {b:3}: fused {fs['median']:.2f} ms, modules {ms['median']:.2f} ms, "
                    f"{rs['median']:.2f}x [{rs['min']:.2f}-{rs['max']:.2f}]",
                    flush=True,
                )
            result["dtypes"][dtype_name] = rows  # type: ignore[index]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
