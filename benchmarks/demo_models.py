"""Held-out evaluation of the bundled demo models, and their model cards.

On the standard-library files the training script held out (scripts/demo_data.py: one file in 20,
by a hash of its path), in non-overlapping windows of 512 tokens, every token after a window's first
is predicted by: the target, the draft, a unigram and a bigram count model (add-one smoothing,
counted on the training split). Reports each one's perplexity, the models' top-1 accuracy, and the
draft's greedy top-1 agreement with the target (the share of positions where their argmax tokens
agree: what bounds speculative acceptance). Both models are evaluated from the shipped bfloat16
weights, in float32. Also records tokenmill's greedy 64-token completion of `def fibonacci(n):`
with the served model's default settings, and two seeded samples at temperature 0.7. Writes
benchmarks/results/demo_models.json and the README.md model card in each model folder.

Usage: python benchmarks/demo_models.py [--models models] [--max-windows 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import string
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "scripts"))
from demo_data import HELD_OUT_EVERY, split, token_stream  # noqa: E402

WINDOW = 512
PROMPT = "def fibonacci(n):"


def count_models(train: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add-one log-probabilities: unigram [vocab], and the bigram's counts [vocab * vocab] with row totals."""
    uni = np.bincount(train, minlength=vocab).astype(np.float64)
    log_uni = np.log((uni + 1) / (uni.sum() + vocab))
    pairs = np.bincount(train[:-1].astype(np.int64) * vocab + train[1:], minlength=vocab * vocab).astype(np.int32)
    rows = np.bincount(train[:-1], minlength=vocab).astype(np.float64)
    return log_uni, pairs, rows


def windows(stream: np.ndarray, limit: int) -> np.ndarray:
    n = min(len(stream) // WINDOW, limit)
    return stream[: n * WINDOW].reshape(n, WINDOW)  # [windows, WINDOW]


@torch.inference_mode()
def model_pass(folder: Path, wins: np.ndarray) -> tuple[float, np.ndarray]:
    """Summed NLL over every predicted token, and the argmax predictions [windows, WINDOW - 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    nll, preds = 0.0, []
    for start in range(0, len(wins), 8):
        batch = torch.from_numpy(wins[start : start + 8].astype(np.int64))
        logits = model(input_ids=batch).logits[:, :-1].float()  # [b, WINDOW - 1, vocab]
        nll += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        preds.append(logits.argmax(-1).numpy())
    return nll, np.concatenate(preds)


def completions(folder: Path) -> dict[str, Any]:
    """The greedy 64-token completion of PROMPT, and two seeded samples (temperature 0.7, seeds 0, 1)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folder))
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    sampled = [
        llm.generate([PROMPT], SamplingParams(temperature=0.7, max_tokens=64, seed=s), use_tqdm=False)[0]
        for s in (0, 1)
    ]
    return {
        "prompt": PROMPT,
        "text": greedy.outputs[0].text,
        "finish_reason": greedy.outputs[0].finish_reason,
        "sampled_temperature_0.7": [o.outputs[0].text for o in sampled],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(ROOT.parent / "models"))
    parser.add_argument("--max-windows", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    target, draft = Path(args.models) / "tokenmill-demo", Path(args.models) / "tokenmill-demo-draft"
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    train_files, held_out_files = split()
    train, held = token_stream(tok, train_files), token_stream(tok, held_out_files)
    wins = windows(held, args.max_windows)
    prev, nxt = wins[:, :-1].reshape(-1).astype(np.int64), wins[:, 1:].reshape(-1).astype(np.int64)
    count = len(nxt)
    log_uni, pairs, rows = count_models(train, vocab)
    uni_nll = -log_uni[nxt].sum()
    bi_nll = -np.log((pairs[prev * vocab + nxt] + 1.0) / (rows[prev] + vocab)).sum()
    t_nll, t_pred = model_pass(target, wins)
    d_nll, d_pred = model_pass(draft, wins)
    truth = wins[:, 1:]
    logs = {
        name: json.loads((f / "training_log.json").read_text()) for name, f in (("target", target), ("draft", draft))
    }
    result: dict[str, Any] = {
        "held_out": {
            "files": len(held_out_files),
            "tokens": len(held),
            "predicted_tokens": count,
            "rule": f"one file in {HELD_OUT_EVERY} by sha256 of its path",
        },
        "training_tokens": len(train),
        "perplexity": {
            "target": math.exp(t_nll / count),
            "draft": math.exp(d_nll / count),
            "bigram_add_one": math.exp(bi_nll / count),
            "unigram_add_one": math.exp(uni_nll / count),
        },
        "top1_accuracy": {"target": float((t_pred == truth).mean()), "draft": float((d_pred == truth).mean())},
        "draft_target_top1_agreement": float((t_pred == d_pred).mean()),
        "completion": completions(target),
        "sizes_mb": sum(f.stat().st_size for d in (target, draft) for f in d.iterdir()) / 2**20,
        "training": {name: {k: v for k, v in log.items() if k != "history"} for name, log in logs.items()},
    }
    ppl = result["perplexity"]
    result["target_vs_bigram"] = 1 - ppl["target"] / ppl["bigram_add_one"]
    out = ROOT / "results" / "demo_models.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for folder, role in ((target, "target"), (draft, "draft")):
        (folder / "README.md").write_text(model_card(folder.name, role, result, logs))
    print(
        json.dumps(
            {k: result[k] for k in ("perplexity", "top1_accuracy", "draft_target_top1_agreement", "target_vs_bigram")},
            indent=1,
        )
    )
    print(result["completion"]["text"])
    print(f"wrote {out} and the model cards")


def model_card(name: str, role: str, r: dict[str, Any], logs: dict[str, dict[str, Any]]) -> str:
    log = logs[role]
    s, ppl, env = log["shape"], r["perplexity"], log["environment"]
    target = role == "target"
    values = {
        "name": name,
        "role_text": "model" if target else "draft model",
        "default_text": " (the default model of `tokenmill serve` and `tokenmill generate`)" if target else "",
        "pair_text": "Its draft for speculative decoding is `tokenmill-demo-draft`."
        if target
        else "It is the draft for speculative decoding with `tokenmill-demo`.",
        "params_m": f"{log['parameters'] / 1e6:.2f}M",
        "params": f"{log['parameters']:,}",
        "hidden": s["hidden"],
        "layers": s["layers"],
        "heads": s["heads"],
        "kv_heads": s["kv_heads"],
        "head_dim": s["hidden"] // s["heads"],
        "intermediate": s["intermediate"],
        "context": log["context"],
        "python": env["python"],
        "held_rule": r["held_out"]["rule"],
        "held_files": r["held_out"]["files"],
        "held_tokens": f"{r['held_out']['tokens']:,}",
        "train_tokens": f"{r['training_tokens']:,}",
        "steps": f"{s['steps']:,}",
        "batch": s["batch"],
        "tokens_seen": f"{log['tokens_seen']:,}",
        "epochs": f"{log['tokens_seen'] / log['training_tokens_available']:.2f}",
        "lr": s["lr"],
        "seed": log["seed"],
        "threads": env["threads"],
        "torch": env["torch"],
        "minutes": f"{log['seconds'] / 60:.0f}",
        "total_minutes": f"{sum(x['seconds'] for x in logs.values()) / 60:.0f}",
        "final_loss": f"{log['final_train_loss']:.3f}",
        "log_every": log["history"][-1]["step"] - log["history"][-2]["step"] if len(log["history"]) > 1 else 1,
        "predicted": f"{r['held_out']['predicted_tokens']:,}",
        "ppl_target": f"{ppl['target']:.2f}",
        "ppl_draft": f"{ppl['draft']:.2f}",
        "ppl_bigram": f"{ppl['bigram_add_one']:.2f}",
        "ppl_unigram": f"{ppl['unigram_add_one']:.2f}",
        "acc_target": f"{r['top1_accuracy']['target']:.1%}",
        "acc_draft": f"{r['top1_accuracy']['draft']:.1%}",
        "vs_bigram": f"{r['target_vs_bigram']:.0%}",
        "agreement": f"{r['draft_target_top1_agreement']:.1%}",
        "prompt": r["completion"]["prompt"],
        "completion": r["completion"]["prompt"] + r["completion"]["text"],
        "sampled_0": r["completion"]["prompt"] + r["completion"]["sampled_temperature_0.7"][0],
        "sampled_1": r["completion"]["prompt"] + r["completion"]["sampled_temperature_0.7"][1],
    }
    return string.Template((ROOT / "templates" / "model_card.md").read_text()).substitute(values)


if __name__ == "__main__":
    main()
