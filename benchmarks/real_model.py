"""Evidence that SmolLM2-135M-Instruct is the real model, served right: tokenmill against transformers
on the same weights, in float32.

1. Perplexity on held-out text: the standard-library files the demo models held out
   (scripts/demo_data.py), tokenized with SmolLM2's tokenizer, concatenated, cut into windows of 512
   tokens; every token after a window's first is scored. tokenmill's figure comes from the engine's
   prompt logprobs (`LLM.generate` with `prompt_logprobs=0`, prefix caching off), transformers' from
   its forward's log-softmax. The two must agree within 0.05%.
2. Greedy chat answers to ten fixed questions (the model's chat template, 64 new tokens): tokenmill's
   against transformers' `generate`, token for token, where a divergence is allowed only at a near tie
   (both tokens within 1e-3 nats on both sides; the comparison stops there).

The weights are the GGUF's 4-bit (Q4_1) weights dequantized, the only copy of SmolLM2 here: this
project's "full precision" SmolLM2. Writes benchmarks/results/real_model.json.

Usage: python benchmarks/real_model.py [--model models/smollm2-135m-instruct] [--windows 24]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "scripts"))
from demo_data import read, split  # noqa: E402

WINDOW = 512
NEAR_TIE_NATS = 1e-3
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "Name three primary colors.",
    "What is the boiling point of water in Celsius?",
    "Write a Python function that returns the square of a number.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is 7 times 8?",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
)


def held_out_windows(tokenizer: Any, count: int) -> np.ndarray:
    """[count, WINDOW] token ids of the held-out files, concatenated (no special tokens)."""
    ids: list[int] = []
    for relative in split()[1]:
        ids.extend(tokenizer.encode(read(relative), add_special_tokens=False))
        if len(ids) >= count * WINDOW:
            break
    n = min(count, len(ids) // WINDOW)
    return np.asarray(ids[: n * WINDOW], dtype=np.int64).reshape(n, WINDOW)


def tokenmill_nll(llm: Any, wins: np.ndarray) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([w.tolist() for w in wins], params, use_tqdm=False)
    total = 0.0
    for out, win in zip(outs, wins, strict=True):
        entries = out.prompt_logprobs[1:]  # the first prompt token has no prediction
        assert [e.token_id for e in entries] == win[1:].tolist()
        total -= sum(e.logprob for e in entries)
    return total


@torch.inference_mode()
def transformers_nll(model: Any, wins: np.ndarray) -> float:
    total = 0.0
    for start in range(0, len(wins), 4):
        batch = torch.from_numpy(wins[start : start + 4])
        logprobs = torch.log_softmax(model(input_ids=batch).logits[:, :-1].double(), dim=-1)  # [b, WINDOW - 1, vocab]
        total -= logprobs.gather(-1, batch[:, 1:, None]).sum().item()
    return total


def compare_greedy(
    ours: list[int], ours_lp: list[dict[int, float]], ref: list[int], ref_lp: list[dict[int, float]]
) -> str:
    """'equal', 'near tie at J' (allowed), or 'DIVERGED at J' (not allowed)."""
    for j, (x, y) in enumerate(zip(ours, ref, strict=False)):
        if x == y:
            continue
        close = all(x in lp and y in lp and abs(lp[x] - lp[y]) <= NEAR_TIE_NATS for lp in (ours_lp[j], ref_lp[j]))
        return f"near tie at {j}" if close else f"DIVERGED at {j}"
    return "equal" if len(ours) == len(ref) else f"DIVERGED in length ({len(ours)} vs {len(ref)})"


@torch.inference_mode()
def chat_answers(llm: Any, model: Any, tokenizer: Any, max_tokens: int) -> list[dict[str, Any]]:
    from tokenmill import SamplingParams

    rows = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    eos = set(llm.engine.tokenizer.info.eos_token_ids)
    for question in QUESTIONS:
        prompt = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ours = list(out.token_ids)
        ours_lp = [dict(e.top) | {e.token_id: e.logprob} for e in out.logprobs]
        gen = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        ref = gen.sequences[0, len(prompt) :].tolist()
        ref_lp = []
        for scores in gen.scores:
            lp = torch.log_softmax(scores[0].double(), dim=-1)
            top = torch.topk(lp, 5)
            ref_lp.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        verdict = compare_greedy(ours, ours_lp, ref, ref_lp)
        rows.append({"question": question, "answer": out.text, "tokens": len(ours), "vs_transformers": verdict})
        print(f"{verdict:>16}  {question!r} -> {out.text!r}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT.parent / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--windows", type=int, default=24, help="held-out windows of 512 tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "results" / "real_model.json"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM

    folder = Path(args.model)
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=False, max_num_seqs=8)
    tokenizer = llm.engine.tokenizer.hf
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    wins = held_out_windows(tokenizer, args.windows)
    scored = wins.shape[0] * (WINDOW - 1)
    t0 = time.perf_counter()
    ours = tokenmill_nll(llm, wins)
    t1 = time.perf_counter()
    ref = transformers_nll(model, wins)
    t2 = time.perf_counter()
    ppl_ours, ppl_ref = math.exp(ours / scored), math.exp(ref / scored)
    rel = abs(ppl_ours - ppl_ref) / ppl_ref
    print(
        f"perplexity over {scored} held-out tokens: tokenmill {ppl_ours:.4f}, transformers {ppl_ref:.4f}, "
        f"relative difference {rel:.2e} (bound 5e-4)"
    )
    chats = chat_answers(llm, model, tokenizer, args.max_tokens)
    result = {
        "model": str(folder),
        "dtype": "float32",
        "weights": "SmolLM2-135M-Instruct.Q4_1.gguf dequantized (the only copy here)",
        "machine": {"cpu": platform.processor(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "perplexity": {
            "windows": int(wins.shape[0]),
            "window": WINDOW,
            "scored_tokens": scored,
            "tokenmill": ppl_ours,
            "transformers": ppl_ref,
            "relative_difference": rel,
            "bound": 5e-4,
            "seconds": {"tokenmill": t1 - t0, "transformers": t2 - t1},
        },
        "chat": chats,
        "chat_equal_or_near_tie": sum(not c["vs_transformers"].startswith("DIVERGED") for c in chats),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    ok = rel <= 5e-4 and result["chat_equal_or_near_tie"] == len(QUESTIONS)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
