"""Start-up benchmark: the seconds from launching `tokenmill serve` until /health answers 200, cold
and warm, per dtype and quantization, and the memory the server holds resident then (VmRSS, with any
child process's).

Cold: an empty `$TOKENMILL_CACHE_DIR` (no autotune choices, no quantized weights), except for the
native kernels' build, which is linked in (built once per machine and tokenmill version, by the
first run ever, whatever the model). Warm: the same cache folder again, right after. Each variant
(`bf16`: `--dtype bfloat16`; `int8`, `int4`, `w8a8`: that `--quantization` over bfloat16) runs
cold then warm, the variants interleaved in each of `--repeats` rounds; the median per (model,
variant, cold / warm) is reported, with every run's seconds and the server's own start-up lines
(the phases and the resolution line's kernel-choice count) from the last run. Writes
benchmarks/results/startup.json (or `--out`: a bare name goes there too).

A `--model` may be a GGUF file (served as it is stored; cold and warm differ by its header and
tokenizer, parsed and built on the cold start and read from the cache after); `--gguf-variants`
(default bf16) are the variants it runs.

Usage: python benchmarks/startup.py [--model models/tokenmill-demo] [--model /tmp/peers/mid-llama]
       [--model /tmp/peers/gguf/mid-llama-q4_k_m.gguf] [--variants bf16,int8,int4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
    "w8a8": ["--dtype", "bfloat16", "--quantization", "w8a8"],
}
KEEP = re.compile(r"start-up:|kernel choices|KV cache:|listening|Uvicorn running|ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kernels_dir() -> Path:
    """The native kernels' build folder of the usual cache (linked into every cold cache)."""
    base = Path(os.environ.get("TOKENMILL_CACHE_DIR", Path.home() / ".cache" / "tokenmill"))
    return base / "kernels"


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` and its children, MiB (/proc: VmRSS, children lists)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):  # (gone meanwhile, or a kernel thread without VmRSS)
            continue
    return total


def start_once(model: Path, flags: list[str], cache: Path, timeout: float) -> tuple[float, float, list[str]]:
    """Seconds from launch to /health 200 for one `tokenmill serve` with `cache` as its cache folder,
    the MiB the server (with any child) holds resident then, and the start-up lines it logged; the
    server is stopped after."""
    port = free_port()
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    for room in ("QUANTIZED", "GGUF"):  # (every cache in the run's folder)
        env.pop(f"TOKENMILL_{room}_CACHE_DIR", None)
    log = cache.parent / f"{cache.name}.log"
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port), *flags]
    with open(log, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited ({proc.returncode}); its log: {log.read_text()[-2000:]}")
                if time.perf_counter() - start > timeout:
                    raise SystemExit(f"no /health 200 after {timeout} s; its log: {log.read_text()[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        seconds = time.perf_counter() - start
                        rss = rss_mib(proc.pid)
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    lines = [line.strip()[:300] for line in log.read_text().splitlines() if KEEP.search(line)]
    return seconds, rss, lines


def fresh_cache(root: Path, name: str) -> Path:
    """An empty cache folder but for the native kernels' build, linked in."""
    cache = root / name
    cache.mkdir()
    if kernels_dir().is_dir():
        (cache / "kernels").symlink_to(kernels_dir())
    return cache


def write(
    args: argparse.Namespace,
    runs: dict[str, dict[str, list[float]]],
    lines: dict[str, dict[str, list[str]]],
    loads: dict[str, dict[str, list[float]]],
    rss: dict[str, dict[str, list[float]]],
) -> dict:
    """The result file as it stands: medians of the runs so far, with the CPU and the load it ran under."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((ln.split(":", 1)[1] for ln in cpuinfo if ln.startswith("flags")), "")
    result = {
        "what": "seconds from `tokenmill serve` launched to /health 200; median of the repeats",
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": " ".join(sorted(flags.split())),
        "cores": os.cpu_count(),
        "repeats": args.repeats,
        "median_s": {k: {s: statistics.median(v) for s, v in states.items()} for k, states in runs.items()},
        "runs_s": runs,
        "rss_mib_median": {k: {s: statistics.median(v) for s, v in states.items()} for k, states in rss.items()},
        "rss_mib": rss,
        "load_average_1min": loads,
        "startup_lines_last_run": lines,
    }
    (RESULTS / args.out).write_text(json.dumps(result, indent=1) + "\n")  # (an absolute --out stays as given)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="model folder (repeatable)")
    parser.add_argument("--variants", default="bf16,int8,int4")
    parser.add_argument("--gguf-variants", default="bf16", help="the variants a GGUF file runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(RESULTS / "startup.json"))
    args = parser.parse_args()
    models = [Path(m) for m in (args.model or [ROOT / "models" / "tokenmill-demo"])]
    variants = args.variants.split(",")
    runs: dict[str, dict[str, list[float]]] = {}
    lines: dict[str, dict[str, list[str]]] = {}
    loads: dict[str, dict[str, list[float]]] = {}  # the 1-minute load average as each run ended
    rss: dict[str, dict[str, list[float]]] = {}  # MiB resident when ready
    root = Path(tempfile.mkdtemp(prefix="tokenmill-startup-"))
    try:
        for r in range(args.repeats):
            for model in models:
                for variant in args.gguf_variants.split(",") if model.suffix == ".gguf" else variants:
                    key = f"{model.name} {variant}"
                    cache = fresh_cache(root, f"{model.name}-{variant}-{r}")
                    for state in ("cold", "warm"):
                        seconds, held, logged = start_once(model, VARIANTS[variant], cache, args.timeout)
                        runs.setdefault(key, {}).setdefault(state, []).append(round(seconds, 2))
                        lines.setdefault(key, {})[state] = logged
                        loads.setdefault(key, {}).setdefault(state, []).append(round(os.getloadavg()[0], 1))
                        rss.setdefault(key, {}).setdefault(state, []).append(round(held))
                        print(f"{key} {state}: {seconds:.1f} s, {held:.0f} MiB resident", flush=True)
                        write(args, runs, lines, loads, rss)  # (after every run: a long table kept if cut short)
                    shutil.rmtree(cache, ignore_errors=True)  # (a quantized 1B model: a gigabyte or two)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = write(args, runs, lines, loads, rss)
    print(f"{'model variant':32} {'cold s':>8} {'warm s':>8} {'MiB cold':>9} {'MiB warm':>9}")
    for key, med in result["median_s"].items():
        held = result["rss_mib_median"][key]
        print(f"{key:32} {med['cold']:8.1f} {med['warm']:8.1f} {held['cold']:9.0f} {held['warm']:9.0f}")


if __name__ == "__main__":
    main()
