"""Decode-step benchmark: the reference path (`torch` attention + `torch` layer ops) beside the
native one (`cpu` attention: the paged kernel; `cpu` layer ops: fused norms, SwiGLU, rotary), on the
`small` peer model, in one process, interleaved (median of repeats, spread shown):

- the decode step at batch 32 with contexts drawn uniformly from 512-2,048 tokens (seeded), and the
  ratio reference / native per repeat;
- the batch-1 step (context 128), and where both steps' time goes: the weight matrices (every `Linear`
  layer and the logits), attention (the backend's `forward`, KV write included), and the rest
  (embedding, norms, rotary, activations, Python) — timed by wrapping those calls, which adds a few
  microseconds per call to "the rest";
- the torch ops a decode step dispatches per layer on each path (torch profiler, top-level ops).

Usage: python benchmarks/decode_step.py [--repeats 3] [--threads 2] [--out benchmarks/results/decode_step.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, ensure_model

from tokenmill.bench.metrics import spread
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.loader import load_model
from tokenmill.runner.cpu_memory import keep_freed_memory

BLOCK = 16
PATHS = {"reference": ("torch", "torch"), "native": ("cpu", "cpu")}  # name -> (attention backend, layer ops)


class Decoder:
    """One model on one path, with a paged cache holding `lens` tokens per sequence (random K/V)."""

    def __init__(self, folder: Path, dtype: torch.dtype, path: str) -> None:
        backend_name, ops_name = PATHS[path]
        self.backend = get_attention_backend(backend_name)
        self.model = load_model(folder, dtype=dtype, backend=self.backend, ops=get_layer_ops(ops_name))
        self.dtype = dtype

    def setup(self, lens: list[int], steps: int) -> None:
        cfg = self.model.config
        per_seq = [-(-(n + steps + 1) // BLOCK) for n in lens]
        self.caches = allocate_kv_cache(
            self.backend, cfg.num_layers, sum(per_seq), BLOCK, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        for c in self.caches:  # stand-ins for the prompts' keys and values: attention reads them all
            c.k.normal_()
            c.v.normal_()
        starts = [sum(per_seq[:b]) for b in range(len(lens))]
        self.tables = [list(range(s, s + n)) for s, n in zip(starts, per_seq, strict=True)]
        self.lens = list(lens)

    def step(self) -> None:
        self.lens = [n + 1 for n in self.lens]
        batch = len(self.lens)
        md = self.backend.build_metadata([1] * batch, self.lens, self.tables, BLOCK)
        positions = torch.tensor([n - 1 for n in self.lens])
        hidden = self.model(torch.zeros(batch, dtype=torch.int64), positions, self.caches, md)
        self.model.compute_logits(hidden)


def time_steps(d: Decoder, lens: list[int], steps: int) -> float:
    """ms per decode step, after one untimed step."""
    d.setup(lens, steps + 1)
    d.step()
    t = time.perf_counter()
    for _ in range(steps):
        d.step()
    return (time.perf_counter() - t) / steps * 1e3


def time_split(d: Decoder, lens: list[int], steps: int) -> dict[str, float]:
    """ms per decode step in the matrices, in attention, and in the rest."""
    spent = {"matrices": 0.0, "attention": 0.0}

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[key] += time.perf_counter() - t
            return out

        return run

    linears = [m for m in d.model.modules() if isinstance(m, LinearBase)]
    originals = [(m, m.forward) for m in linears]
    for m in linears:
        m.forward = timed(m.forward, "matrices")  # type: ignore[method-assign]
    backend_forward = d.backend.forward
    d.backend.forward = timed(backend_forward, "attention")  # type: ignore[method-assign]
    compute_logits = d.model.compute_logits
    if d.model.config.tie_word_embeddings:  # the logits are a plain F.linear then; else lm_head is timed above
        d.model.compute_logits = timed(compute_logits, "matrices")  # type: ignore[method-assign]
    try:
        d.setup(lens, steps + 1)
        d.step()
        spent.update(matrices=0.0, attention=0.0)
        t = time.perf_counter()
        for _ in range(steps):
            d.step()
        total = time.perf_counter() - t
    finally:
        for m, f in originals:
            m.forward = f  # type: ignore[method-assign]
        d.backend.forward = backend_forward  # type: ignore[method-assign]
        d.model.compute_logits = compute_logits  # type: ignore[method-assign]
    ms = {k: v / steps * 1e3 for k, v in spent.items()}
    ms["rest"] = total / steps * 1e3 - ms["matrices"] - ms["attention"]
    ms["total"] = total / steps * 1e3
    return ms


def ops_per_layer(d: Decoder) -> float:
    """Top-level torch ops one batch-1 decode step dispatches, per layer."""
    d.setup([128], 4)
    d.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        d.step()
    top = [e for e in prof.events() if e.cpu_parent is None]
    return len(top) / d.model.config.num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "decode_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    keep_freed_memory()
    folder = ensure_model()
    rng = random.Random(0)  # one generator: a new one per draw gave every sequence the same context
    long_lens = [rng.randint(512, 2048) for _ in range(32)]
    result: dict[str, Any] = {
        "model": "make-model --arch llama --size small --seed 0 (54.9M parameters)",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "repeats": args.repeats,
        "paths": {k: {"attention_backend": a, "layer_ops": o} for k, (a, o) in PATHS.items()},
        "batch32_contexts": long_lens,
        "dtypes": {},
    }
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            decoders = {p: Decoder(folder, dtype, p) for p in PATHS}
            samples: dict[str, dict[str, list[float]]] = {p: {"b32": [], "b1": []} for p in PATHS}
            splits: dict[str, dict[str, list[dict[str, float]]]] = {p: {"b32": [], "b1": []} for p in PATHS}
            for _ in range(args.repeats):  # interleaved
                for p, d in decoders.items():
                    samples[p]["b32"].append(time_steps(d, long_lens, args.steps))
                    samples[p]["b1"].append(time_steps(d, [128], args.steps * 4))
                    splits[p]["b32"].append(time_split(d, long_lens, args.steps))
                    splits[p]["b1"].append(time_split(d, [128], args.steps * 4))
            entry: dict[str, Any] = {}
            for p, d in decoders.items():
                entry[p] = {
                    "decode_b32_ctx512_2048_ms": spread(samples[p]["b32"]),
                    "decode_b1_ctx128_ms": spread(samples[p]["b1"]),
                    **{
                        f"{key}_split_ms": {k: spread([s[k] for s in splits[p][key]]) for k in splits[p][key][0]}
                        for key in ("b32", "b1")
                    },
                    "ops_per_layer": ops_per_layer(d),
                }
            ref, nat = samples["reference"], samples["native"]
            entry["speedup"] = {
                key: spread([r / n for r, n in zip(ref[key], nat[key], strict=True)]) for key in ("b32", "b1")
            }
            result["dtypes"][dtype_name] = entry
            print(f"\n{dtype_name}{'':22}{'reference':>24}{'native':>24}  reference / native")
            for key, label in (("b32", "decode b=32 ctx 512-2048"), ("b1", "decode b=1 ctx 128")):
                cells = [spread(samples[p][key]) for p in PATHS]
                text = [f"{c['median']:.2f} [{c['min']:.2f}-{c['max']:.2f}] ms" for c in cells]
                s = entry["speedup"][key]
                print(f"{label:30}{text[0]:>24}{text[1]:>24}  {s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]")
            for p in PATHS:
                for key in ("b32", "b1"):
                    split = entry[p][f"{key}_split_ms"]
                    parts = ", ".join(f"{k} {split[k]['median']:.2f}" for k in ("matrices", "attention", "rest"))
                    print(f"  {key} split, {p}: {parts} ms (of {split['total']['median']:.2f})")
                print(f"  {p}: {entry[p]['ops_per_layer']:.1f} torch ops per layer per decode step")
            del decoders
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
