"""The prompt product on GGUF blocks kept quantized: `gguf_gemm` (int8 activations, kernels/csrc/gguf_gemm.cpp)
and `gguf_gemm_widened` (each tile of weight rows dequantized in cache for float32 outer-product tiles,
AVX2) against the dequantize-then-GEMM path they replace (`GGUFBlocksMethod(prompt_kernel="dequant")`),
and the engine's prefill rate beside llama.cpp's on the same files.

- **kernels**: per block type and TinyLlama-1.1B shape (2048->2560 qkv, 2048->11264 gate_up, 5632->2048
  down, 2048->2048 o) at 128 and 512 x rows, the layer method's product through each path, alternated
  within every repeat; GFLOP/s median [min-max]. Where the CPU has AVX-512 VNNI, also `repacked`: the
  same matrix in 16-row groups (kernels/csrc/gguf_x16.cpp), as the engine loads it there.
- **engine** (`--engine`): for each GGUF file, one process loads `LLM(file)` (prefix caching off) and
  times a prompt of each `--lengths` (128 and 512) distinct random tokens (one new token: the prefill) with every
  GGUFBlocksMethod in the process set to each path in turn; then `llama-bench -p <lengths> -n 0` on the same
  file and thread count. Both alternate within each repeat; tokens/s median [min-max]. Each of
  `--layouts` (the `gguf_layout` setting: how Q8_0 / Q4_0 / Q4_1 matrices are kept) loads its own
  process: under `int` those layers run tokenmill's int8 / int4 methods whatever the path label says;
  under `blocks` they take the path named.

Writes benchmarks/results/gguf_prefill.json (or `--out`).

Usage: python benchmarks/gguf_prefill.py [--repeats 3] [--threads 2] [--engine] [--files q4_k_m,q4_0]
       [--layouts auto] [--paths dequant,gemm,widened]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((2560, 2048), (11264, 2048), (2048, 5632), (2048, 2048))  # [N, K]: out, in
ROWS = (128, 512)
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0")
PEERS = Path("/tmp/peers")
PATHS = ("dequant", "gemm", "widened")


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def kernel_cases(repeats: int, dtype_name: str) -> dict[str, dict[str, list[float]]]:
    """GFLOP/s of each path per case, one value a repeat (paths alternated within each repeat)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gguf_kernels import pool_blocks

    from tokenmill.kernels.cpu_build import cpu_flags, load_cpu_kernels
    from tokenmill.quant.gguf_method import BLOCKS, GGUFBlocksMethod, GGUFMatrix, repack

    kernels = load_cpu_kernels()
    assert kernels is not None, "the native kernels did not build"
    dtype = getattr(torch, dtype_name)
    methods = {p: GGUFBlocksMethod(kernels, prompt_kernel=p) for p in PATHS}
    if "avx512_vnni" in cpu_flags().split():  # (the 16-row form's vector kernel; elsewhere a scalar reference)
        methods["repacked"] = GGUFBlocksMethod(kernels, prompt_kernel="gemm")
    rates: dict[str, dict[str, list[float]]] = {}
    for type_name in TYPES:
        _, weights, size = BLOCKS[type_name]
        for n, k in SHAPES:
            mat = GGUFMatrix(type_name, pool_blocks(type_name, n * (k // weights) * size, size).view(n, -1), k)
            layer = type("L", (), {"gguf_parts": [(0, mat)], "output_size": n})()
            layers = {p: layer for p in methods}
            if "repacked" in methods:
                layers["repacked"] = type("L", (), {"gguf_parts": [(0, repack(mat, kernels.ops))], "output_size": n})()
            for m in ROWS:
                x = torch.randn(m, k, dtype=dtype)
                case = rates.setdefault(f"{type_name} {n}x{k} m={m}", {p: [] for p in methods})
                for _ in range(repeats):
                    for p, method in methods.items():
                        method.apply(layers[p], x, None)  # warm
                        start = time.perf_counter()
                        method.apply(layers[p], x, None)
                        case[p].append(2 * m * n * k / (time.perf_counter() - start) / 1e9)
            print(
                type_name,
                n,
                k,
                {
                    c: {p: f"{statistics.median(v):.0f}" for p, v in r.items()}
                    for c, r in rates.items()
                    if c.startswith(f"{type_name} {n}x{k}")
                },
                flush=True,
            )
    return rates


def engine_child(path: str, threads: int, layout: str, paths: list[str], lengths: list[int]) -> dict[str, float]:
    """(In a child process) prefill tokens/s of `path` at each of `lengths` tokens, through each prompt path."""
    import torch

    torch.set_num_threads(threads)
    from tokenmill import LLM, SamplingParams
    from tokenmill.quant.gguf_method import GGUFBlocksMethod

    llm = LLM(path, enable_prefix_caching=False, gguf_layout=layout)
    methods = [o for o in gc.get_objects() if isinstance(o, GGUFBlocksMethod)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = torch.Generator().manual_seed(0)
    out: dict[str, float] = {"blocks_methods": float(len(methods))}
    llm.generate([torch.randint(100, 30000, (64,), generator=rng).tolist()], params, use_tqdm=False)  # warm
    for length in lengths:
        for p in paths:
            for method in methods:
                method.prompt_kernel = p
            ids = torch.randint(100, 30000, (length,), generator=rng).tolist()
            llm.generate([ids[:8]], params, use_tqdm=False)  # (this path's code warm)
            start = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            out[f"tokenmill {layout} {p} p{length}"] = length / (time.perf_counter() - start)
    return out


def llama_bench(path: str, threads: int, lengths: list[int]) -> dict[str, float]:
    binary = PEERS / "llamacpp-build" / "bin" / "llama-bench"
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    cmd = [
        str(binary),
        "-m",
        path,
        "-p",
        ",".join(map(str, lengths)),
        "-n",
        "0",
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return {f"llama.cpp p{r['n_prompt']}": float(r["avg_ts"]) for r in json.loads(done.stdout)}


def engine_cases(
    files: list[str], repeats: int, threads: int, layouts: list[str], paths: list[str], lengths: list[int]
) -> dict[str, dict[str, list[float]]]:
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(repeats):
        for name in files:
            path = str(PEERS / "gguf" / f"mid-llama-{name}.gguf")
            ours: dict[str, float] = {}
            for layout in layouts:
                cmd = [sys.executable, __file__, "--engine-child", path, "--threads", str(threads)]
                cmd += ["--layouts", layout, "--paths", ",".join(paths), "--lengths", ",".join(map(str, lengths))]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
                ours |= json.loads(done.stdout.strip().splitlines()[-1])
            for label, value in {**ours, **llama_bench(path, threads, lengths)}.items():
                runs.setdefault(name, {}).setdefault(label, []).append(value)
            print(
                f"repeat {r + 1}/{repeats} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in {**ours}.items()),
                flush=True,
            )
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="activations of the kernel cases")
    ap.add_argument("--engine", action="store_true", help="also the engine's prefill beside llama-bench")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--files", default="q4_k_m,q4_0")
    ap.add_argument("--layouts", default="auto", help="gguf_layout values, a process each (auto,blocks,int)")
    ap.add_argument("--paths", default=",".join(PATHS), help="the blocks method's prompt paths (dequant,gemm,widened)")
    ap.add_argument("--lengths", default="128,512", help="the engine's prompt lengths (llama-bench's -p)")
    ap.add_argument("--out", default=str(RESULTS / "gguf_prefill.json"))
    ap.add_argument("--engine-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_child:
        lengths = [int(n) for n in args.lengths.split(",")]
        print(json.dumps(engine_child(args.engine_child, args.threads, args.layouts, args.paths.split(","), lengths)))
        return
    import torch

    torch.set_num_threads(args.threads)
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()  # noqa: E731
    from tokenmill.kernels.cpu_build import cpu_flags

    report: dict[str, object] = {"benchmark": "gguf_prefill", "repeats": args.repeats, "threads": args.threads}
    report["cpu_flags"] = cpu_flags()
    report["uptime_before"] = uptime()
    if not args.no_kernels:
        rates = kernel_cases(args.repeats, args.dtype)
        report["kernels_gflop_s"] = {c: {p: summary(v) for p, v in r.items()} for c, r in rates.items()}
        report["kernel_dtype"] = args.dtype
    if args.engine:
        layouts, paths = args.layouts.split(","), args.paths.split(",")
        lengths = [int(n) for n in args.lengths.split(",")]
        runs = engine_cases(args.files.split(","), args.repeats, args.threads, layouts, paths, lengths)
        report["engine_tok_s"] = {f: {label: summary(v) for label, v in r.items()} for f, r in runs.items()}
    report["uptime_after"] = uptime()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for section in ("kernels_gflop_s", "engine_tok_s"):
        for case, per in report.get(section, {}).items():  # type: ignore[union-attr]
            cells = (f"{label} {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]" for label, s in per.items())
            print(f"{case:28} " + "  ".join(cells))


if __name__ == "__main__":
    main()
