"""Weights on 2 MB pages (`cpu_huge_pages`, runner/huge_pages.py) against 4 KB pages.

SmolLM2-135M-Instruct, a decode step (the whole `LLMEngine.step`) of 1, 4 and 16 requests at a
128-token context, median of 12 steps, in float32 and in bfloat16. Each measurement is its own process
(of several engines in one process the first built runs slower, and a process's memory layout is
what is compared), alternating on / off, the order flipped each repeat; the figure is the per-repeat
ratio off / on (above 1: huge pages faster), median and spread.

Writes benchmarks/results/huge_pages.json.

Usage: python benchmarks/huge_pages.py [--repeats 3] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from common import RESULTS, ROOT

SMOLLM2 = ROOT.parent / "models" / "smollm2-135m-instruct"
BATCHES = (1, 4, 16)


def child(model: str, dtype: str, huge: bool) -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.doctor.step_cost import Prober
    from tokenmill.engine.engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model, dtype=dtype, cpu_huge_pages=huge, enable_prefix_caching=False, max_num_seqs=max(BATCHES)
    )
    engine = LLMEngine(config)
    prober = Prober(engine, seed=0)
    prober.decode(1, 32, 512, 2)  # warm-up
    steps = {b: prober.decode(b, 128, config.max_num_batched_tokens, 6) * 1e3 for b in BATCHES}
    smaps = Path("/proc/self/smaps_rollup").read_text().splitlines()
    huge_kb = next((int(line.split()[1]) for line in smaps if line.startswith("AnonHugePages")), 0)
    print(json.dumps({"step_ms": steps, "anon_huge_pages_mib": huge_kb / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--out", default=str(RESULTS / "huge_pages.json"))
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "HUGE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child[0], args.child[1] == "1")
        return
    from tokenmill.kernels.cpu_build import cpu_flags
    from tokenmill.runner.huge_pages import thp_mode

    runs: dict[str, dict[str, list[dict]]] = {}
    for repeat in range(args.repeats):
        for dtype in args.dtypes.split(","):
            for huge in (True, False) if repeat % 2 == 0 else (False, True):
                cmd = [sys.executable, __file__, "--model", args.model, "--child", dtype, "1" if huge else "0"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
                result = json.loads(out.strip().splitlines()[-1])
                runs.setdefault(dtype, {"on": [], "off": []})["on" if huge else "off"].append(result)
                print(f"#{repeat} {dtype} huge pages {'on' if huge else 'off'}: {result}", flush=True)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for dtype, sides in runs.items():
        summary[dtype] = {}
        for b in BATCHES:
            key = str(b)
            ratios = [
                off["step_ms"][key] / on["step_ms"][key] for on, off in zip(sides["on"], sides["off"], strict=True)
            ]
            summary[dtype][key] = {
                "on_ms": statistics.median(r["step_ms"][key] for r in sides["on"]),
                "off_ms": statistics.median(r["step_ms"][key] for r in sides["off"]),
                "speedup": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(), "thp": thp_mode()},
        "model": Path(args.model).name,
        "context": 128,
        "runs": runs,
        "summary": summary,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| dtype | batch | 4 KB pages (ms) | 2 MB pages (ms) | speed-up [range] |")
    print("|---|---|---|---|---|")
    for dtype, rows in summary.items():
        for b, r in rows.items():
            spread = f"[{r['min']:.2f}-{r['max']:.2f}]"
            print(f"| {dtype} | {b} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['speedup']:.2f}x {spread} |")


if __name__ == "__main__":
    main()
