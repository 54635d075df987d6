"""Engine benchmark: continuous vs static batching vs transformers `generate`, offline, in one run.

Workload (fixed seed): 200 requests, prompts of 32-512 random tokens, output lengths long-tailed
between 8 and 512 (log-normal, median 64), EOS ignored, greedy; all submitted at once. Variants,
interleaved in every repeat, same max batch size (32) and dtype:
- tokenmill, continuous batching;
- tokenmill, static batching (a batch admitted whole with KV reserved for prompt + max_tokens);
- transformers `generate` in left-padded batches of 32 in arrival order, each batch generating
  until its longest request is done (only requested tokens are counted).

Reports output tokens/s, mean end-to-end latency (submission -> request done), the share of
allocated KV slots holding live tokens (mean over steps), and the time per step outside the model
forward with 32 sequences decoding.

Usage: python benchmarks/engine.py [--dtype float32] [--repeats 3] [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
MODEL_DIR = ROOT / ".models" / "small-llama"
MAX_NUM_SEQS = 32


def ensure_model() -> Path:
    from tokenmill.models.make_model import make_model

    if not (MODEL_DIR / "config.json").is_file():
        make_model("llama", "small", MODEL_DIR, seed=0)
    return MODEL_DIR


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(5, 32000) for _ in range(rng.randint(32, 512))]
        length = min(512, max(8, round(math.exp(rng.gauss(math.log(64), 1.0)))))
        out.append((prompt, length))
    return out


def run_tokenmill(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    engine = llm.engine
    t0 = time.perf_counter()
    for i, (prompt, length) in enumerate(work):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
    done: dict[str, float] = {}
    live = allocated = 0
    overhead_32: list[float] = []
    step_32: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter() - t0
                tokens += len(out.outputs[0].token_ids)
        s = engine.last_step
        live += s.kv_live_tokens
        allocated += s.kv_allocated_slots
        if s.num_running == MAX_NUM_SEQS and s.num_batched_tokens == MAX_NUM_SEQS:  # 32 decoding
            overhead_32.append(s.total_seconds - s.forward_seconds)
            step_32.append(s.total_seconds)
    wall = time.perf_counter() - t0
    assert tokens == sum(length for _, length in work)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return {
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "mean_e2e_s": statistics.mean(done.values()),
        "kv_live_share": live / allocated if allocated else 0.0,
        "overhead_ms_32_decoding": statistics.median(overhead_32) * 1e3 if overhead_32 else None,
        "step_ms_32_decoding": statistics.median(step_32) * 1e3 if step_32 else None,
        "steps_32_decoding": len(step_32),
        "preemptions": stats["preemptions"],
    }


def run_hf(model: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    done: list[float] = []
    tokens = 0
    for b in range(0, len(work), MAX_NUM_SEQS):
        batch = work[b : b + MAX_NUM_SEQS]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for i, (p, _) in enumerate(batch):  # left padding, as generate expects
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(length for _, length in batch)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2
        )
        finished = time.perf_counter() - t0
        done.extend([finished] * len(batch))
        tokens += sum(length for _, length in batch)
    wall = time.perf_counter() - t0
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall, "mean_e2e_s": statistics.mean(done)}


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = ensure_model()
    work = workload(args.requests, seed=0)
    common = {"dtype": args.dtype, "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512, "max_model_len": 1024}
    engines = {
        "continuous": LLM(str(folder), scheduling="continuous", **common),
        "static": LLM(str(folder), scheduling="static", **common),
    }
    hf = None
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    warm = workload(4, seed=1)
    for llm in engines.values():
        run_tokenmill(llm, warm)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*engines, *(["transformers"] if hf else [])]}
    for r in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(run_tokenmill(llm, work))
            print(f"repeat {r} {name}: {json.dumps(runs[name][-1])}", flush=True)
        if hf is not None:
            with torch.inference_mode():
                runs["transformers"].append(run_hf(hf, work))
            print(f"repeat {r} transformers: {json.dumps(runs['transformers'][-1])}", flush=True)

    def ratio(a: str, b: str) -> dict[str, Any]:
        return summary(
            [x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in zip(runs[a], runs[b], strict=True)]
        )

    result: dict[str, Any] = {
        "model": "make-model --arch llama --size small --seed 0 (54.9M parameters)",
        "dtype": args.dtype,
        "threads": args.threads,
        "workload": {
            "requests": args.requests,
            "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(n for _, n in work),
            "seed": 0,
        },
        "max_num_seqs": MAX_NUM_SEQS,
        "repeats": args.repeats,
        "variants": {
            name: {key: summary([run[key] for run in rs]) for key in rs[0] if rs[0][key] is not None}
            for name, rs in runs.items()
        },
        "ratios": {"continuous_vs_static_tokens_per_s": ratio("continuous", "static")},
    }
    if hf is not None:
        result["ratios"]["continuous_vs_transformers_tokens_per_s"] = ratio("continuous", "transformers")
    cont = result["variants"]["continuous"]
    overhead = cont["overhead_ms_32_decoding"]["median"]
    step = cont["step_ms_32_decoding"]["median"]
    result["overhead_share_32_decoding"] = overhead / step
    out = Path(args.out or ROOT / "results" / f"engine_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))
    print(
        f"KV live share: continuous {cont['kv_live_share']['median']:.3f}, "
        f"static {result['variants']['static']['kv_live_share']['median']:.3f}; "
        f"overhead with 32 decoding: {overhead:.2f} ms of {step:.2f} ms ({overhead / step:.1%})"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
