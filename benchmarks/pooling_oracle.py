"""The pooling oracles' figures: tokenmill's embeddings and rerank scores against transformers, on
make-model folders (tiny, random weights: no real embedder or reranker can be downloaded here).

For each family (Llama, Qwen2, Qwen3) and pooling (last, mean, cls, from the folder's
sentence-transformers config) the largest absolute difference between `LLM.embed` and transformers'
last hidden state (after the final norm) pooled and normalized the same way, over prompts of 1 to ~130
tokens run in chunks of 32 tokens, float32. For a reranker (`task="rerank"`, Qwen3-Reranker's
template) the largest difference between `LLM.score` and softmax(yes, no) of transformers' logits at
the last position, and whether the documents' order is the same. Accuracy figures, not timings.

Usage: python benchmarks/pooling_oracle.py [--out results/pooling_oracle.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill import LLM
from tokenmill.tools.make_model import make_model, write_sentence_transformers

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = ("llama", "qwen2", "qwen3")
POOLINGS = ("last", "mean", "cls")
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3,
    "x",
    "The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.sum())",
]
DOCS = [*TEXTS, "fibonacci numbers in python", "a fox and a dog"]
QUERY = "how do I compute fibonacci numbers?"


def hf_model(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def embed_diff(base: Path, work: Path, pooling: str) -> dict[str, object]:
    folder = work / pooling
    shutil.copytree(base, folder)
    write_sentence_transformers(folder, pooling)
    llm = LLM(str(folder), max_model_len=512, max_num_batched_tokens=32, kv_cache_memory=64 << 20)
    outs = llm.embed(TEXTS, use_tqdm=False)
    hf = hf_model(folder)
    worst = 0.0
    for out in outs:
        with torch.no_grad():
            hidden = hf(torch.tensor([out.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0]
        ref = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
        worst = max(worst, (torch.tensor(out.outputs.embedding) - F.normalize(ref, dim=-1)).abs().max().item())
    lengths = [len(o.prompt_token_ids) for o in outs]
    return {"pooling": pooling, "max_abs_diff": worst, "prompt_tokens": lengths}


def rerank_diff(folder: Path) -> dict[str, object]:
    llm = LLM(str(folder), max_model_len=512, max_num_batched_tokens=32, kv_cache_memory=64 << 20, task="rerank")
    scores = [s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)]
    pooling = llm.engine.pooling
    yes, no = pooling.score_token_ids
    hf = hf_model(folder)
    ref = []
    for doc in DOCS:
        with torch.no_grad():
            logits = hf(torch.tensor([pooling.rerank_prompt(QUERY, doc)])).logits[0, -1]
        ref.append(torch.softmax(logits[[yes, no]], dim=-1)[0].item())
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    return {
        "max_abs_diff": max(abs(a - b) for a, b in zip(scores, ref, strict=True)),
        "order": order,
        "order_equal": order == sorted(range(len(DOCS)), key=lambda i: -ref[i]),
        "scores": scores,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "pooling_oracle.json"))
    args = parser.parse_args()
    results: dict[str, object] = {"dtype": "float32", "tolerance": 1e-4, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in FAMILIES:
            base = make_model(arch, "tiny", Path(tmp) / arch, seed=1)
            work = Path(tmp) / f"{arch}-embed"
            work.mkdir()
            embeddings = [embed_diff(base, work, p) for p in POOLINGS]
            results["families"][arch] = {"embed": embeddings, "rerank": rerank_diff(base)}  # type: ignore[index]
            for e in embeddings:
                print(f"{arch} {e['pooling']:>4}: max abs diff {e['max_abs_diff']:.2e}")
            rerank = results["families"][arch]["rerank"]  # type: ignore[index]
            print(f"{arch} rerank: max abs diff {rerank['max_abs_diff']:.2e}, order equal {rerank['order_equal']}")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
