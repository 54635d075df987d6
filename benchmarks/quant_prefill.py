"""The prefill rate of a model quantized at load (`--quantization int8 | int4`) through each of its
prompt kernels, beside llama.cpp's prompt rate on the GGUF file of the same precision.

One child process a repeat loads `LLM(model, dtype=bfloat16, quantization=Q)` (prefix caching off),
then for each `--lengths` prompt (distinct random tokens, one new token: the prefill) and each of
`--kernels` sets every quantized layer's choice for prompt rows (65 and more; decode and batch rows
keep theirs) to that kernel and times the prompt; `llama-bench -p <lengths> -n 0` on `--peer-file`
runs right after in the same repeat, on the same thread count. Repeats interleave the two engines;
each figure is the median tokens/s [min-max]. The machine's CPU flags are recorded with them.

Writes benchmarks/results/quant_prefill_<Q>.json (or `--out`, a name there or an absolute path).

Usage: python benchmarks/quant_prefill.py --quantization int8 [--kernels tiled,broadcast]
       [--lengths 128,1017] [--model /tmp/peers/mid-llama] [--peer-file /tmp/peers/gguf/mid-llama-q8_0.gguf]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = Path("/tmp/peers")
PROMPT_ROWS = 65  # the first row count of the prompt class (kernels/defaults.py)


def child(model: str, quantization: str, threads: int, kernels: list[str], lengths: list[int]) -> dict[str, float]:
    """(In a child process) prefill tokens/s at each length through each prompt kernel."""
    import torch

    torch.set_num_threads(threads)
    from tokenmill import LLM, SamplingParams
    from tokenmill.quant.int_methods import QuantizedLinearMethod

    llm = LLM(model, dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    methods = [o for o in gc.get_objects() if isinstance(o, QuantizedLinearMethod)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for length in lengths:
        for kernel in kernels:
            for method in methods:
                for shape, table in method.plan.items():
                    method.plan[shape] = (*table[:PROMPT_ROWS], kernel)  # rows past the table: its last entry
            ids = torch.randint(100, 30000, (length,), generator=rng).tolist()
            llm.generate([ids[: PROMPT_ROWS + 8]], params, use_tqdm=False)  # this kernel's code warm
            start = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            out[f"tokenmill {quantization} {kernel} p{length}"] = length / (time.perf_counter() - start)
    return out


def llama_bench(path: str, threads: int, lengths: list[int]) -> dict[str, float]:
    """gguf_prefill.py's llama-bench run, each rate labelled with the file's name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gguf_prefill import llama_bench as run

    return {f"llama.cpp {Path(path).stem} {k.split()[-1]}": v for k, v in run(path, threads, lengths).items()}


def cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), platform.processor())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--kernels", default="tiled,broadcast", help="the prompt kernels, compared in each repeat")
    ap.add_argument("--lengths", default="128,1017")
    ap.add_argument("--model", default=str(PEERS / "mid-llama"))
    ap.add_argument("--peer-file", help="GGUF file for llama-bench (default: mid-llama's q8_0 / q4_0 file)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kernels, lengths = args.kernels.split(","), [int(n) for n in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(args.model, args.quantization, args.threads, kernels, lengths)))
        return
    peer = args.peer_file or str(PEERS / "gguf" / f"mid-llama-{'q8_0' if args.quantization == 'int8' else 'q4_0'}.gguf")
    runs: dict[str, list[float]] = {}
    for r in range(args.repeats):
        cmd = [sys.executable, __file__, "--child", "--quantization", args.quantization, "--model", args.model]
        cmd += ["--kernels", args.kernels, "--lengths", args.lengths, "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rates = json.loads(done.stdout.strip().splitlines()[-1]) | llama_bench(peer, args.threads, lengths)
        for label, value in rates.items():
            runs.setdefault(label, []).append(value)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()), flush=True)
    table = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in runs.items()}
    for label, row in table.items():
        print(f"{label:40s} {row['median']:7.1f} tok/s [{row['min']:.1f}-{row['max']:.1f}]")
    out = {
        "model": args.model,
        "peer_file": peer,
        "quantization": args.quantization,
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu_flags": cpu_flags(),
        "load_average": os.getloadavg(),
        "prefill_tok_s": table,
    }
    path = RESULTS / (args.out or f"quant_prefill_{args.quantization}.json")  # (an absolute --out stays as given)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
