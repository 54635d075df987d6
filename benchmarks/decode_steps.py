"""Several decode steps in a row (`--decode-steps N`) against a step a token, in one process, interleaved.

One engine, greedy requests of 128 prompt and 128 new tokens (EOS ignored), all added at once, for
each batch size; each repeat runs the batch once with `decode_steps` 1 and once with N (the scheduler's
setting switched between runs, the same engine and weights), alternating which goes first. Reports
output tokens/s (prefill included), the ratio N / 1 per repeat (median and spread), and whether both
gave the same tokens. Model: the peer model by default (`benchmarks/.models/small-llama`), or `--model`
(a folder or a GGUF file).

`--against loop`: both sides run N in a row; the base steps through them forward by forward in Python
(the model's `greedy_run` declined), the other in the one native call (decode_layer.cpp's `decode_run`).

Usage: python benchmarks/decode_steps.py [--model DIR|FILE] [--dtype bfloat16] [--steps 4] [--batches 1,4,16]
       [--repeats 5] [--against single|loop] [--quantization int8] [--gguf-layout int]
       [--out results/decode_steps.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from common import RESULTS, ensure_model

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_build import cpu_flags


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", choices=("single", "loop"), default="single")
    parser.add_argument("--quantization", default=None, help="int8, int4, w8a8: quantized at load")
    parser.add_argument("--gguf-layout", default="auto", help="int8 / int4 in GGUF blocks or tokenmill's formats")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_steps.json")
    args = parser.parse_args()
    model = args.model or str(ensure_model())
    quant = {"quantization": args.quantization, "gguf_layout": args.gguf_layout}
    llm = LLM(model, dtype=args.dtype, enable_prefix_caching=False, decode_steps=args.steps, **quant)
    scheduler, net = llm.engine.core.scheduler, llm.engine.core.worker.runner.model
    native = net.greedy_run

    def use(side: int) -> None:  # 1: the base (a step a token, or forward by forward), else the runs / the call
        if args.against == "single":
            scheduler.config = dataclasses.replace(scheduler.config, decode_steps=side)
        else:
            net.greedy_run = native if side != 1 else (lambda *a, **k: None)

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rows = []
    base, other = ("a step a token", f"{args.steps} in a row") if args.against == "single" else ("loop", "native")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[100 + i + j for j in range(128)] for i in range(batch)]
        rates: dict[int, list[float]] = {1: [], args.steps: []}
        tokens: dict[int, list[list[int]]] = {}
        timed(llm, prompts, params)  # (warm: the runner times this batch size's forwards)
        for repeat in range(args.repeats):
            order = (1, args.steps) if repeat % 2 == 0 else (args.steps, 1)
            for steps in order:
                use(steps)
                rate, tokens[steps] = timed(llm, prompts, params)
                rates[steps].append(rate)
        ratios = [n / one for n, one in zip(rates[args.steps], rates[1], strict=True)]
        row = {
            "batch": batch,
            "tok_s": {
                str(k): {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
                for k, v in rates.items()
            },
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "samples": ratios},
            "same_tokens": tokens[1] == tokens[args.steps],
        }
        rows.append(row)
        print(
            f"batch {batch:3}: {base} {statistics.median(rates[1]):7.1f} tok/s, {other} "
            f"{statistics.median(rates[args.steps]):7.1f}: {row['ratio']['median']:.3f}x "
            f"[{row['ratio']['min']:.3f}-{row['ratio']['max']:.3f}], same tokens: {row['same_tokens']}"
        )
    result = {
        "model": model,
        "dtype": args.dtype,
        **quant,
        "steps": args.steps,
        "against": args.against,
        "repeats": args.repeats,
        "workload": "greedy, 128 prompt + 128 new tokens, the batch added at once",
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
