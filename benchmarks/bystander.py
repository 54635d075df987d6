"""What one request's constraint lists cost the request beside it (issue 42 item 4).

One engine (`LLMEngine`, the bundled demo model, its default dtype, one process) runs a bystander
request (a 16-token prompt, 64 new tokens, no constraints) alone, and beside a heavy request that
decodes for as long, carrying one of: 50,000 `bad_words` (words of random letters, each barred alone
and after a space, so about 100,000 token sequences), 2,000 `allowed_token_ids`, 300 `logit_bias`
entries, or 5 `bad_words` (a request with a short list: the price of a processor being on at all).
The bystander's tokens/s is its 64 tokens over the wall time of the steps from its admission to its
end; the heavy request's own set-up (tokenizing its words) happens before the clock starts. Each
case is measured `--repeats` times (default 3), the cases interleaved within each repeat; the JSON
holds every run, the median and the spread (min, max).

Usage: python benchmarks/bystander.py [--out benchmarks/results/bystander.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import subprocess
import time
from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "tokenmill-demo"
NEW_TOKENS = 64


def word_sequences(engine: LLMEngine, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word alone and after a space as token ids, as the front end turns bad_words into them (done
    here, outside the clock: the step's cost is what is measured)."""
    encode = engine.processor.tokenizer.encode
    seqs = {tuple(encode(t, add_special_tokens=False)) for w in words for t in (w, " " + w)}
    return tuple(sorted(s for s in seqs if s))


def heavy_params(case: str, engine: LLMEngine) -> SamplingParams | None:
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    common: dict[str, Any] = {"max_tokens": 4 * NEW_TOKENS, "ignore_eos": True, "temperature": 0.0}
    if case == "alone":
        return None
    if case == "bad_words_50000":
        words = tuple("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(50_000))
        return SamplingParams(bad_words_token_ids=word_sequences(engine, words), **common)
    if case == "bad_words_5":
        words = ("mill", "grain", "stone", "wheel", "river")
        return SamplingParams(bad_words_token_ids=word_sequences(engine, words), **common)
    if case == "allowed_token_ids_2000":
        return SamplingParams(allowed_token_ids=tuple(rng.sample(range(vocab), 2000)), **common)
    if case == "logit_bias_300":
        return SamplingParams(logit_bias={t: rng.uniform(-5, 5) for t in rng.sample(range(vocab), 300)}, **common)
    raise ValueError(case)


CASES = ("alone", "bad_words_5", "bad_words_50000", "allowed_token_ids_2000", "logit_bias_300")


def run_case(engine: LLMEngine, case: str, run: int) -> float:
    """The bystander's tokens/s beside `case`'s heavy request."""
    params = heavy_params(case, engine)
    if params is not None:
        engine.add_request(f"heavy-{case}-{run}", list(range(100, 116)), params)
        engine.step()  # (the heavy request admitted and decoding before the bystander arrives)
    bystander = f"bystander-{case}-{run}"
    start = time.perf_counter()
    engine.add_request(
        bystander, list(range(200, 216)), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    )
    done = False
    while not done:
        done = any(o.request_id == bystander and o.finished for o in engine.step())
    seconds = time.perf_counter() - start
    if params is not None:
        engine.abort_request(f"heavy-{case}-{run}")
    while engine.has_unfinished_requests():
        engine.step()
    return NEW_TOKENS / seconds


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bystander.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=str(DEMO))
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    run_case(engine, "alone", -1)  # warm-up
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    for repeat in range(args.repeats):
        for case in CASES:
            runs[case].append(run_case(engine, case, repeat))
            print(f"repeat {repeat} {case}: {runs[case][-1]:.1f} tok/s", flush=True)
    alone = statistics.median(runs["alone"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    result = {
        "benchmark": "bystander",
        "commit": commit.stdout.strip(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
        "cases": {
            case: {
                "tok_s_median": round(statistics.median(v), 1),
                "tok_s_min": round(min(v), 1),
                "tok_s_max": round(max(v), 1),
                "of_alone": round(statistics.median(v) / alone, 3),
                "runs": [round(x, 1) for x in v],
            }
            for case, v in runs.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for case, c in result["cases"].items():
        print(
            f"{case:>24}: {c['tok_s_median']:7.1f} tok/s [{c['tok_s_min']}, {c['tok_s_max']}], "
            f"{c['of_alone']:.2f}x alone"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
