"""The GGUF decode product (`gguf_linear`, kernels/csrc/gguf_blocks.cpp) as a memory reader: per block
type, per TinyLlama-1.1B matrix shape, at 1 and 8 x rows, the weight bytes it reads a second, beside
the machine's streaming read bandwidth (benchmarks/bandwidth.py's readers) measured in the same run.

Each matrix is read from memory, not the last-level cache: the weights are slices of a pool of random
blocks (float16 fields set to 0.01) several times the L3, and successive calls take successive slices,
as a decode step's layers do. One measurement of a tree (a source checkout whose kernels are built and
loaded) runs in a process of its own: the bandwidth readers, then every (type, shape, rows) for about
`--seconds` each. Trees alternate within each of `--repeats` repeats (interleaved, so the machine's
other load falls on all of them alike); reported per tree and case: GB/s median [min-max] over the
repeats, and the fraction of the same repeats' bandwidth figure. The load (`uptime`) before and after
is written beside. Writes benchmarks/results/gguf_kernels.json (or `--out`).

Usage: python benchmarks/gguf_kernels.py --tree before=/path/to/main --tree after=. [--repeats 5]
       [--types Q4_K,Q6_K] [--seconds 0.15] [--threads N] [--forms file,x16]

`--forms file,x16` measures each matrix as the file's blocks and repacked into 16-row groups (the form
`gguf_repack` chooses per CPU kind, kernels/defaults.py), one after the other in the same child.

On a machine shared with other jobs, a product split over every core waits for its slowest thread
whenever another process holds a core; `--threads 1` measures the kernels alone (against one
thread's read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((2048, 2048), (256, 2048), (5632, 2048), (2048, 5632), (32000, 2048))  # [N, K]: out, in
ROWS = (1, 8)
TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
HALVES = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def pool_blocks(type_name: str, nbytes: int, block: int):  # -> uint8 tensor [nbytes // block, block]
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(nbytes // block, block), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for offset in HALVES.get(type_name, (0,)):
        raw[:, offset : offset + 2] = half
    return torch.from_numpy(raw)


def measure_tree(types: list[str], seconds: float, threads: int, forms: list[str]) -> dict[str, object]:
    """(In the child process) bandwidth, then GB/s of every case once, on `threads` threads (0: torch's
    default), each form of the matrices in turn (`file`: the file's blocks; `x16`: repacked into 16-row
    groups, kernels/csrc/gguf_x16.cpp; the rate counts the file's bytes either way)."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bandwidth import l3_bytes
    from bandwidth import measure as bandwidth

    from tokenmill.kernels.cpu_build import load_cpu_kernels
    from tokenmill.quant.gguf_method import BLOCKS, REPACKED_TYPES

    kernels = load_cpu_kernels()
    assert kernels is not None, "the native kernels did not build"
    band = bandwidth(0.5, 5)
    pool_bytes = max(4 * l3_bytes(), 128 << 20)
    cases: dict[str, float] = {}
    for type_name in types:
        code, weights, size = BLOCKS[type_name]
        pool = pool_blocks(type_name, pool_bytes, size).view(-1)  # [pool bytes]
        for n, k in SHAPES:
            row = k // weights * size
            copies = pool.numel() // (n * row)  # (the pool holds at least one of every shape)
            file = [pool[i * n * row : (i + 1) * n * row].view(n, row) for i in range(copies)]
            for form in forms:
                x16 = form == "x16"
                if x16 and type_name not in REPACKED_TYPES:
                    continue
                mats = [kernels.ops.gguf_repack16(mat, code) for mat in file] if x16 else file
                form_code = code + 100 if x16 else code
                for m in ROWS:
                    x = torch.randn(m, k, dtype=torch.bfloat16)
                    out = torch.empty(m, n, dtype=torch.bfloat16)
                    for mat in mats[:2]:  # warm the code path
                        kernels.ops.gguf_linear(out, x, mat, form_code)
                    calls, start = 0, time.perf_counter()
                    while time.perf_counter() - start < seconds or calls < 2 * len(mats[:8]):
                        kernels.ops.gguf_linear(out, x, mats[calls % len(mats)], form_code)
                        calls += 1
                    elapsed = time.perf_counter() - start
                    cases[f"{type_name}{' x16' if x16 else ''} {n}x{k} m={m}"] = calls * n * row / elapsed / 1e9
                del mats
        del pool, file
    return {"bandwidth_gb_s": band["read_gb_s"], "threads": torch.get_num_threads(), "cases": cases}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="label=path of a source tree (repeatable)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--seconds", type=float, default=0.15, help="timed seconds per case and repeat")
    ap.add_argument("--threads", type=int, default=0, help="threads (0: torch's default, every core)")
    ap.add_argument("--forms", default="file", help="the matrices' forms measured: file, x16 (repacked) or both")
    ap.add_argument("--out", default=str(RESULTS / "gguf_kernels.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    types = args.types.split(",")
    if args.child:
        print(json.dumps(measure_tree(types, args.seconds, args.threads, args.forms.split(","))))
        return
    from tokenmill.kernels.cpu_build import isa_cap_settings

    trees = dict(t.split("=", 1) for t in (args.tree or ["after=" + str(Path(__file__).resolve().parent.parent)]))
    runs: dict[str, list[dict[str, object]]] = {label: [] for label in trees}
    load_before = uptime()
    for r in range(args.repeats):
        for label, path in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
            cmd = [sys.executable, __file__, "--child", "--types", args.types, "--seconds", str(args.seconds)]
            cmd += ["--threads", str(args.threads), "--forms", args.forms]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1}/{args.repeats} {label}: bandwidth {runs[label][-1]['bandwidth_gb_s']:.1f} GB/s")
    report: dict[str, object] = {
        "benchmark": "gguf_kernels",
        "uptime_before": load_before,
        "uptime_after": uptime(),
        "repeats": args.repeats,
        "trees": trees,
        "threads": runs[next(iter(trees))][0]["threads"],
        "forms": args.forms.split(","),
        "isa_cap": isa_cap_settings(),  # (TOKENMILL_MAX_ISA and torch's caps, where set)
        "results": {},
    }
    for label, reps in runs.items():
        band = [float(rep["bandwidth_gb_s"]) for rep in reps]  # type: ignore[arg-type]
        per: dict[str, object] = {"bandwidth_gb_s": summary(band)}
        for case in reps[0]["cases"]:  # type: ignore[union-attr]
            rates = [float(rep["cases"][case]) for rep in reps]  # type: ignore[index]
            frac = [rate / b for rate, b in zip(rates, band, strict=True)]
            per[case] = {"gb_s": summary(rates), "of_bandwidth": statistics.median(frac)}
        report["results"][label] = per  # type: ignore[index]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    labels = list(trees)
    print(f"{'case':28}" + "".join(f"{label:>26}" for label in labels))
    for case in reps[0]["cases"]:  # type: ignore[union-attr]
        cells = []
        for label in labels:
            c = report["results"][label][case]  # type: ignore[index]
            g = c["gb_s"]
            cells.append(f"{g['median']:6.2f} [{g['min']:.2f}-{g['max']:.2f}] {c['of_bandwidth']:4.0%}")
        print(f"{case:28}" + "".join(f"{cell:>26}" for cell in cells))


if __name__ == "__main__":
    main()
