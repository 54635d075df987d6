"""Before/after benchmark: the engine at an earlier commit against the working tree, side by side.

A change that should not move throughput (a restructure) is checked here: a git worktree of
`--before` (default: the commit before issue 12's restructure) and this tree each run the same two
measurements, interleaved in every repeat (the order alternating), each in its own process:
- engine: `tokenmill bench offline` on the `small` peer model, benchmarks/engine.py's workload
  (`mixed`, seed 0, prompts 32-512 and outputs 8-512 tokens, EOS ignored, greedy, 32 sequences,
  512 batched tokens) with continuous batching, output tokens/s;
- forward: the decode step of the paged forward at batch 1 and 32 (context 128) and the prefill
  of a 512-token prompt, timed in-process the way benchmarks/forward.py does, with each tree's
  own model code.
Writes benchmarks/results/before_after.json and prints median [min-max] per side and the per-repeat
after/before ratios (above 1: after is faster).

Usage: python benchmarks/before_after.py [--before REF] [--repeats 3] [--requests 100] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ensure_model

from tokenmill.bench.metrics import spread

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "3ea3946"  # issue 11 landed; issue 12's restructure starts after it

# Runs inside each tree's interpreter: times the paged forward with that tree's own code.
FORWARD = r"""
import json, statistics, sys, time, torch
from tokenmill.models.loader import load_model
torch.set_num_threads(int(sys.argv[3]))
folder, dtype = sys.argv[1], getattr(torch, sys.argv[2])
try:  # after the restructure: the backend builds metadata and owns the cache layout
    from tokenmill.layers.attention import allocate_kv_cache
    from tokenmill.layers.backends import get_attention_backend
    backend = get_attention_backend("torch")
    model = load_model(folder, dtype=dtype, backend=backend)
    cfg = model.config
    def caches(blocks):
        return allocate_kv_cache(backend, cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
    build = backend.build_metadata
except ImportError:  # before
    from tokenmill.layers.attention import build_attention_metadata as build
    from tokenmill.runner.kv_cache import allocate_kv_cache as alloc
    model = load_model(folder, dtype=dtype)
    def caches(blocks):
        return alloc(model.config, blocks, 16, dtype)
from tokenmill.runner.cpu_memory import keep_freed_memory
keep_freed_memory()

def step(ids, query_lens, seq_lens, tables, kv):
    md = build(query_lens, seq_lens, tables, 16)
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    with torch.inference_mode():
        hidden = model(ids, pos, kv, md)
        last = torch.tensor([sum(query_lens[: b + 1]) - 1 for b in range(len(query_lens))])
        model.compute_logits(hidden[last])

out = {}
kv = caches(32 * 10 + 40)
tables = [list(range(b * 10, (b + 1) * 10)) for b in range(32)]
prompt = torch.randint(0, 32000, (512,), generator=torch.Generator().manual_seed(0))
times = []
for _ in range(4):
    t = time.perf_counter()
    step(prompt, [512], [512], [list(range(320, 352))], kv)
    times.append(time.perf_counter() - t)
out["prefill_512_tokens_per_s"] = 512 / statistics.median(times[1:])
for batch in (1, 32):
    ids = torch.randint(0, 32000, (batch,), generator=torch.Generator().manual_seed(batch))
    times = []
    for i in range(12):
        t = time.perf_counter()
        step(ids, [1] * batch, [129] * batch, tables[:batch], kv)
        times.append(time.perf_counter() - t)
    out[f"decode_step_ms_batch_{batch}"] = statistics.median(times[2:]) * 1e3
print("RESULT " + json.dumps(out))
"""


def run_engine(tree: Path, model: Path, dtype: str, requests: int, threads: int, out: Path) -> float:
    argv = [sys.executable, "-m", "tokenmill.cli", "bench", "offline", str(model), "--workload", "mixed"]
    argv += ["--num-requests", str(requests), "--input-len", "32:512", "--output-len", "8:512", "--seed", "0"]
    argv += ["--compare", "scheduling=continuous", "--repeats", "1", "--dtype", dtype, "--threads", str(threads)]
    argv += ["--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--max-model-len", "1024"]
    argv += ["--no-progress", "--out", str(out)]
    subprocess.run(argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True)
    result = json.loads(out.read_text())
    return float(result["runs"][-1]["summary"]["output_throughput"])


def run_forward(tree: Path, model: Path, dtype: str, threads: int) -> dict[str, float]:
    argv = [sys.executable, "-c", FORWARD, str(model), dtype, str(threads)]
    done = subprocess.run(
        argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True
    )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return {k: float(v) for k, v in json.loads(line.removeprefix("RESULT ")).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "before_after.json"))
    args = parser.parse_args()
    model = ensure_model()
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-before-"))
    before_tree = scratch / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), args.before], cwd=ROOT, check=True)
    sides = {"before": before_tree, "after": ROOT}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    try:
        for repeat in range(args.repeats):
            order = ["before", "after"] if repeat % 2 == 0 else ["after", "before"]
            for side in order:
                tree = sides[side]
                tps = run_engine(tree, model, args.dtype, args.requests, args.threads, scratch / f"{side}.json")
                samples[side].setdefault("engine_output_tokens_per_s", []).append(tps)
                for key, value in run_forward(tree, model, args.dtype, args.threads).items():
                    samples[side].setdefault(key, []).append(value)
                print(f"repeat {repeat} {side}: {tps:.0f} output tokens/s", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, check=False)
    summary: dict[str, object] = {"before": args.before, "dtype": args.dtype, "requests": args.requests}
    for metric in samples["after"]:
        a, b = samples["after"][metric], samples["before"][metric]
        higher_better = not metric.endswith("_ms_batch_1") and not metric.endswith("_ms_batch_32")
        ratios = [x / y if higher_better else y / x for x, y in zip(a, b, strict=True)]
        summary[metric] = {"before": spread(b), "after": spread(a), "after_over_before": spread(ratios)}
        r = spread(ratios)
        print(
            f"{metric}: before {spread(b)['median']:.2f}, after {spread(a)['median']:.2f}, "
            f"after/before {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
        )
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
