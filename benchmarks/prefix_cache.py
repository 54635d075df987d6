"""Prefix-caching benchmark: TTFT with caching on and off for requests sharing a long system prompt.

64 requests share a 1,024-token system prompt and each add a distinct 64-token question; they are
sent one at a time after one warm-up request, through the offline engine, on the `small` model,
same dtype on both sides. Both variants run in one process, interleaved in every repeat. Reports
TTFT p50 (arrival -> first token) per variant, their ratio, and cached tokens against the
theoretical maximum (every full block of the shared prompt, for every request after the warm-up).

Usage: python benchmarks/prefix_cache.py [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import torch

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
MODEL_DIR = ROOT / ".models" / "small-llama"
SYSTEM, QUESTION, REQUESTS, BLOCK = 1024, 64, 64, 16


def ensure_model() -> Path:
    from tokenmill.models.make_model import make_model

    if not (MODEL_DIR / "config.json").is_file():
        make_model("llama", "small", MODEL_DIR, seed=0)
    return MODEL_DIR


def run(llm: LLM, system: list[int], questions: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([system + questions[0]], params, use_tqdm=False)  # warm-up: fills the cache when on
    ttfts, cached = [], 0
    for q in questions[1:]:
        out = llm.generate([system + q], params, use_tqdm=False)[0]
        assert out.metrics.first_token_time is not None
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        cached += out.num_cached_tokens
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_mean_s": statistics.mean(ttfts), "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(ensure_model())
    rng = random.Random(0)
    system = [rng.randrange(5, 32000) for _ in range(SYSTEM)]
    common = {"dtype": args.dtype, "max_model_len": 2048, "kv_cache_memory": 512 * 1024**2}
    variants = {"on": LLM(folder, **common), "off": LLM(folder, enable_prefix_caching=False, **common)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r in range(args.repeats):
        questions = [[rng.randrange(5, 32000) for _ in range(QUESTION)] for _ in range(REQUESTS + 1)]
        for name, llm in variants.items():
            if name == "on":  # a fresh cache every repeat: the warm-up request is what fills it
                variants[name] = llm = LLM(folder, **common)
            runs[name].append(run(llm, system, questions))
            print(f"repeat {r} {name}: {json.dumps(runs[name][-1])}", flush=True)
    ratios = [off["ttft_p50_s"] / on["ttft_p50_s"] for on, off in zip(runs["on"], runs["off"], strict=True)]
    theoretical = REQUESTS * (SYSTEM // BLOCK) * BLOCK
    result = {
        "model": "make-model --arch llama --size small --seed 0",
        "dtype": args.dtype,
        "workload": {"system_tokens": SYSTEM, "question_tokens": QUESTION, "requests": REQUESTS, "block_size": BLOCK},
        "repeats": args.repeats,
        "runs": runs,
        "ttft_p50_ms": {
            name: {
                "median": statistics.median(x["ttft_p50_s"] for x in rs) * 1e3,
                "min": min(x["ttft_p50_s"] for x in rs) * 1e3,
                "max": max(x["ttft_p50_s"] for x in rs) * 1e3,
            }
            for name, rs in runs.items()
        },
        "ttft_p50_ratio_off_over_on": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "cached_share_of_theoretical": statistics.median(x["cached_tokens"] for x in runs["on"]) / theoretical,
    }
    out = Path(args.out or ROOT / "results" / f"prefix_cache_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps({k: result[k] for k in ("ttft_p50_ms", "ttft_p50_ratio_off_over_on", "cached_share_of_theoretical")})
    )


if __name__ == "__main__":
    main()
