"""Decode through the engine on a GGUF file against llama.cpp on the same file: output tok/s at one
request and at eight, the two engines interleaved in every repeat.

tokenmill: `LLM(file, enable_prefix_caching=False)` loaded once per file in a child process (it waits
between measurements, holding its weights), driven through `LLMEngine.step` so that each step is timed
on its own: c requests of a distinct random 128-token prompt and 33 greedy tokens each; the decode rate
is the tokens of the steps in which all c requests decode (no prompt chunk in the step) over those
steps' seconds. Prompt chunks are left out as llama.cpp's figures leave them out, and not mixing the
prompt's seconds into the decode rate keeps its noise out (a 1,024-token prompt batch takes longer than
the 32 decode steps on a small machine).

llama.cpp: c = 1 is `llama-bench -p 0 -n 32` (tg32: 32 tokens after a warm-up), c = 8 is
`llama-batched-bench -npp 128 -ntg 32 -npl 8` (its S_TG: the 8 sequences' 32 decode steps), both on
`--threads` threads (default: torch's thread count, the cores).

With `--layouts` (e.g. `int,blocks`: the `gguf_layout` setting, how Q8_0 / Q4_0 / Q4_1 matrices are
kept) one child per layout is loaded, each measured in turn; `LAYOUT/REPACK` sets `gguf_repack` too
(e.g. `auto/file,auto/x16`: the blocks as the file stores them against repacked in 16-row groups).

Per file, each repeat runs tokenmill c=1 (each layout), llama.cpp c=1, tokenmill c=8, llama.cpp c=8 in
turn, so the machine's other load falls on all alike. Reported: tok/s median [min-max] over the repeats, the ratio
of the medians, the streaming read bandwidth (benchmarks/bandwidth.py, in the same run) and the GB/s
tokenmill's c=1 decode reads (the file's tensor bytes a token). Writes benchmarks/results/gguf_decode.json.

`--model DIR` measures a checkpoint folder instead, in bfloat16 and quantized at load (`--quantizations
none,int8,int4`), each against llama.cpp on the peers' GGUF file of its precision (`DIR`'s name with
-f16, -q8_0, -q4_0: bfloat16 against f16, int8 against q8_0, int4 against q4_0); the GB/s is the bytes
a token reads as tokenmill holds them: every weight less the embedding table (a row of it a token).

Usage: python benchmarks/gguf_decode.py [--gguf FILE ...] [--repeats 3] [--llama-bin DIR] [--layouts auto]
       python benchmarks/gguf_decode.py --model DIR [--quantizations none,int8,int4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PEERS = Path("/tmp/peers")
FILES = [PEERS / "gguf" / f"mid-llama-{q}.gguf" for q in ("q4_k_m", "q4_0", "q8_0")]
PROMPT, NEW = 128, 33  # prompt tokens, new tokens a request (32 decode steps after the first token)


PAIRED_FILE = {"none": "f16", "int8": "q8_0", "int4": "q4_0"}  # --model: llama.cpp's file for each


def child(path: str, layout: str, quantization: str) -> None:
    """(The tokenmill child) load `path` with `gguf_layout` `layout` (LAYOUT/REPACK: `gguf_repack` too)
    and `quantization` (a folder: in bfloat16), then per stdin line `c`: one run of c requests, its
    decode rate as a JSON line on stdout."""
    import random

    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.outputs import OutputKind

    layout, _, repack = layout.partition("/")
    folder = {"dtype": "bfloat16", "quantization": quantization} if Path(path).is_dir() else {}
    llm = LLM(path, enable_prefix_caching=False, gguf_layout=layout, gguf_repack=repack or "auto", **folder)
    engine = llm.engine
    rng = random.Random(0)
    count = 0

    def run(c: int, new: int) -> dict[str, float]:
        nonlocal count
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for _ in range(c):
            count += 1
            prompt = [rng.randrange(100, 30000) for _ in range(PROMPT)]
            engine.add_request(f"decode-{count}", prompt, params, output_kind=OutputKind.FINAL_ONLY)
        seconds, tokens = 0.0, 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            step = engine.core.last_step  # StepStats
            if step.num_running == c and step.num_batched_tokens == c:  # every request decoding, no chunk
                seconds += elapsed
                tokens += c
        return {"tok_s": tokens / seconds if seconds else 0.0, "decode_tokens": tokens}

    run(1, NEW)  # (warm-up: a whole c=1 run, so the first measured one finds every page and path warm)
    model = engine.core.worker.runner.model
    read = model.weight_bytes()  # bytes a token reads: every weight but the table's other rows
    if isinstance(model.embed_tokens, torch.nn.Embedding):  # (a table in blocks: the file's bytes are used)
        read -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "read_bytes": read}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(int(line), NEW)), flush=True)


class Tokenmill:
    """The child process for one file."""

    def __init__(self, path: Path, layout: str, quantization: str = "none") -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(path), "--layouts", layout, "--quantizations", quantization],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.info = self._reply()

    def _reply(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the tokenmill child ended (exit {self.proc.wait()})")

    def rate(self, c: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{c}\n")
        self.proc.stdin.flush()
        return float(self._reply()["tok_s"])  # type: ignore[arg-type]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def llama_rate(bin_dir: Path, path: Path, c: int, threads: int) -> float:
    """llama.cpp's decode tok/s on `path` at c sequences (module docstring)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    if c == 1:
        cmd = [bin_dir / "llama-bench", "-m", path, "-p", "0", "-n", "32", "-t", threads, "-r", "1", "-o", "jsonl"]
        key = "avg_ts"
    else:
        cmd = [bin_dir / "llama-batched-bench", "-m", path, "-c", 4096, "-b", 2048, "-ub", 512]
        cmd += ["-npp", PROMPT, "-ntg", NEW - 1, "-npl", c, "-t", threads, "--output-format", "jsonl"]
        key = "speed_tg"
    out = subprocess.run([str(a) for a in cmd], env=env, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1][key])


def summary(values: list[float]) -> dict[str, object]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def measure_file(
    path: Path, repeats: int, bin_dir: Path, threads: int, layouts: list[str], concs: tuple[int, ...] = (1, 8)
) -> dict[str, object]:
    """A GGUF file served by both: one tokenmill child a layout (measure_pair)."""
    import gguf

    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    sources = {lay: (path, lay, "none") for lay in layouts}
    return measure_pair(path, sources, repeats, bin_dir, threads, concs, tensor_bytes)


def measure_model(
    folder: Path, quantization: str, repeats: int, bin_dir: Path, threads: int, concs: tuple[int, ...] = (1, 8)
) -> dict[str, object]:
    """A checkpoint folder in bfloat16, quantized at load by `quantization`, against llama.cpp on the
    GGUF file of that precision (PAIRED_FILE)."""
    paired = PEERS / "gguf" / f"{folder.name}-{PAIRED_FILE[quantization]}.gguf"
    result = measure_pair(paired, {"auto": (folder, "auto", quantization)}, repeats, bin_dir, threads, concs, None)
    return {**result, "model": str(folder), "quantization": quantization}


def measure_pair(
    path: Path,
    sources: dict[str, tuple[Path, str, str]],
    repeats: int,
    bin_dir: Path,
    threads: int,
    concs: tuple[int, ...],
    read_bytes: int | None,
) -> dict[str, object]:
    """llama.cpp on `path` against tokenmill children (`sources`: layout -> (what it loads, layout,
    quantization)), interleaved. Rates per repeat, keys `tokenmill_c{c}` (one child) or
    `tokenmill_{layout}_c{c}` (several); the ratios of the medians, and each repeat's own ratio
    (`ratios...`: the load shifts between repeats). `read_bytes`: a token's bytes for the GB/s (None:
    what the child says it holds)."""
    layouts = list(sources)
    names = {lay: "tokenmill" if len(layouts) == 1 else f"tokenmill_{lay}" for lay in layouts}
    children: dict[str, Tokenmill] = {}
    rates: dict[str, list[float]] = {f"{n}_c{c}": [] for c in concs for n in [*names.values(), "llama"]}
    try:
        for lay, source in sources.items():
            children[lay] = Tokenmill(*source)
        for _ in range(repeats):
            for c in concs:
                for lay, tm in children.items():
                    rates[f"{names[lay]}_c{c}"].append(tm.rate(c))
                rates[f"llama_c{c}"].append(llama_rate(bin_dir, path, c, threads))
                print(path.name, c, {k: round(v[-1], 1) for k, v in rates.items() if v}, flush=True)
    finally:
        for tm in children.values():
            tm.close()
    first = next(iter(children.values())).info
    read = read_bytes if read_bytes is not None else int(first["read_bytes"])  # type: ignore[call-overload]
    result: dict[str, object] = {
        "file": str(path),
        "tensor_bytes" if read_bytes is not None else "read_bytes": read,
        "tokenmill_threads": first["threads"],
        "layouts": layouts,
        "concurrency": list(concs),
    }
    for k, v in rates.items():
        result[k] = summary(v)
    for n in names.values():
        suffix = n.removeprefix("tokenmill")
        for c in concs:
            ours, peer = rates[f"{n}_c{c}"], rates[f"llama_c{c}"]
            result[f"ratio{suffix}_c{c}"] = statistics.median(ours) / statistics.median(peer)
            result[f"ratios{suffix}_c{c}"] = summary([a / b for a, b in zip(ours, peer, strict=True)])
        if 1 in concs:
            result[f"{n}_c1_gb_s"] = statistics.median(rates[f"{n}_c1"]) * read / 1e9
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", nargs="*", type=Path, default=FILES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bin", type=Path, default=PEERS / "llamacpp-build" / "bin")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp's threads (0: torch's default)")
    ap.add_argument("--concurrency", default="1,8", help="the request counts measured")
    ap.add_argument(
        "--layouts",
        default="auto",
        help="gguf_layout values, one tokenmill child each (auto,blocks,int; auto/file: gguf_repack too)",
    )
    ap.add_argument("--model", type=Path, help="a checkpoint folder instead of GGUF files (module docstring)")
    ap.add_argument("--quantizations", default="none,int8,int4", help="with --model: each against its file")
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_decode.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = set(args.quantizations.split(",")) - set(PAIRED_FILE)
    if args.model and unknown:
        ap.error(f"--quantizations: expected some of {', '.join(PAIRED_FILE)}, got {', '.join(sorted(unknown))}")
    if args.child:
        return child(args.child, args.layouts, args.quantizations)
    import torch

    sys.path.insert(0, str(ROOT))
    from bandwidth import measure as bandwidth

    from tokenmill.kernels.cpu_build import isa_cap_settings

    threads = args.threads or torch.get_num_threads()
    report: dict[str, object] = {"benchmark": "gguf_decode", "uptime_before": _uptime(), "repeats": args.repeats}
    report["bandwidth_gb_s"] = bandwidth(0.5, 5)["read_gb_s"]
    report["llama_bin"] = str(args.llama_bin.resolve())
    if caps := isa_cap_settings():  # (docs/native-kernels.md: another CPU kind's code paths)
        report["isa_cap"] = caps
    files: list[dict[str, object]] = []
    report["files"] = files
    args.out.parent.mkdir(parents=True, exist_ok=True)
    concs = tuple(int(c) for c in args.concurrency.split(","))
    if args.model:
        runs = [partial(measure_model, args.model, q) for q in args.quantizations.split(",")]
    else:
        runs = [partial(measure_file, path, layouts=args.layouts.split(",")) for path in args.gguf]
    for run in runs:  # (the report rewritten after each file)
        files.append(run(repeats=args.repeats, bin_dir=args.llama_bin, threads=threads, concs=concs))
        report["uptime_after"] = _uptime()
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"bandwidth {report['bandwidth_gb_s']:.1f} GB/s")
    for f in report["files"]:  # type: ignore[union-attr]
        name = Path(f["file"]).name + (f" <- {f['quantization']}" if "quantization" in f else "")
        for c in f["concurrency"]:
            ll = f[f"llama_c{c}"]
            for lay in f["layouts"]:
                key = "tokenmill" if len(f["layouts"]) == 1 else f"tokenmill_{lay}"
                t, ratio = f[f"{key}_c{c}"], f[f"ratio{key.removeprefix('tokenmill')}_c{c}"]
                gb_s = f.get(f"{key}_c1_gb_s") if c == 1 else None
                reads = f"  reads {gb_s:.1f} GB/s ({gb_s / report['bandwidth_gb_s']:.0%})" if gb_s else ""
                print(
                    f"{name:24} c={c}  tokenmill {lay:6} {t['median']:6.1f} [{t['min']:.1f}-{t['max']:.1f}]  "
                    f"llama.cpp {ll['median']:6.1f} [{ll['min']:.1f}-{ll['max']:.1f}]  x{ratio:.2f}{reads}"
                )


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
