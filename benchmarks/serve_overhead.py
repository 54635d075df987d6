"""What the HTTP server costs at one request: `tokenmill bench serve` (streamed, and not) against a
`tokenmill serve` beside `tokenmill bench offline` on the same engine settings, interleaved.

The `small` model in float32 (or `--dtype`), prefix caching off, the `random` workload (seed 0): 8 requests of 128
prompt and 128 output tokens (EOS ignored), one at a time (max-concurrency 1). Each repeat runs the
three variants in turn while the others sit idle (the server waits on its queue between runs).
Prints output tokens/s per variant (median [min-max] of the repeats) and serve / offline per repeat;
writes benchmarks/results/serve_overhead.json.

The client runs on the same machine as the server: on a small machine its share of the cores (reading
each streamed event) is part of what the streamed variant measures.

Usage: python benchmarks/serve_overhead.py [--repeats 3] [--requests 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, ensure_model
from common import bench as run_bench
from serve import free_port, start_server

from tokenmill.bench.metrics import spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(RESULTS / "serve_overhead.json"))
    args = parser.parse_args()
    model = ensure_model()
    workload = ["--workload", "random", "--num-requests", str(args.requests), "--seed", "0"]
    workload += ["--input-len", "128", "--output-len", "128", "--max-concurrency", "1", "--no-progress"]
    port = free_port()
    server = start_server(model, port, "--dtype", args.dtype, "--no-enable-prefix-caching", "--log-interval", "600")
    scratch = Path(tempfile.mkdtemp(prefix="serve_overhead_"))  # each run's full result; the summary is ours
    tps: dict[str, list[float]] = {"offline": [], "serve_stream": [], "serve_whole": []}
    try:
        serve_args = [
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--model",
            model.name,
            "--tokenizer",
            str(model),
        ]
        variants = {
            "offline": ["offline", str(model), "--dtype", args.dtype, "--no-enable-prefix-caching", "--warmup", "1"],
            "serve_stream": serve_args,
            "serve_whole": [*serve_args, "--no-stream"],
        }
        run_bench(*variants["serve_stream"], *workload, "--num-requests", "1", "--out", str(scratch / "warm.json"))
        for repeat in range(args.repeats):
            for name, argv in variants.items():
                result = run_bench(*argv, *workload, "--out", str(scratch / f"{name}_{repeat}.json"))
                if result.runs[0].summary["failed"]:
                    raise SystemExit(f"{name}: failed requests; see {scratch}")
                tps[name].append(float(result.runs[0].summary["output_throughput"]))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    out: dict[str, Any] = {
        "model": f"make-model --arch llama --size small --seed 0 (54.9M parameters), {args.dtype}, prefix caching off",
        "workload": "random, 8 requests, 128 prompt + 128 output tokens, max-concurrency 1",
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "output_tokens_per_s": {k: spread(v) for k, v in tps.items()},
        "serve_over_offline": {
            k: spread([s / o for s, o in zip(tps[k], tps["offline"], strict=True)])
            for k in ("serve_stream", "serve_whole")
        },
    }
    for k, v in out["output_tokens_per_s"].items():
        print(f"{k:14} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}] output tokens/s")
    for k, v in out["serve_over_offline"].items():
        print(f"{k:14} / offline: {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
