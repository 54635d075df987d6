"""Train tokenmill's bundled demo models: a Llama target (~5M parameters, GQA) and a draft (~1.4M)
sharing one 8k byte-level BPE tokenizer with a chat template, on the CPython standard library's
sources (PSF license), CPU only, seeded. Writes two Hugging Face folders (bfloat16 safetensors)
with a `training_log.json` each; `benchmarks/demo_models.py` then evaluates them on the held-out
files and writes their model cards.

Reproduce (a long CPU-bound run; nothing else should run meanwhile):
    .venv/bin/python scripts/train_demo_models.py --out models
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_data import read, split, token_stream

from tokenmill.models.train_tokenizer import SpecialTokens, save_tokenizer, train_bpe

VOCAB = 8192
CONTEXT = 512  # training sequence length
MAX_POSITIONS = 1024
TOKENIZER_BYTES = 16_000_000  # the tokenizer learns its merges from this much of the training split


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch: int  # sequences of CONTEXT tokens per step
    lr: float


TARGET = Shape(
    "tokenmill-demo", hidden=256, layers=4, heads=8, kv_heads=2, intermediate=768, steps=4400, batch=8, lr=2e-3
)
DRAFT = Shape(
    "tokenmill-demo-draft", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, steps=2000, batch=8, lr=3e-3
)


def build_model(shape: Shape, specials: dict[str, int]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=specials["bos"],
        eos_token_id=specials["eos"],
        pad_token_id=specials["pad"],
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, shape: Shape) -> float:
    warmup = max(1, shape.steps // 20)
    if step < warmup:
        return shape.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, shape.steps - warmup)
    return shape.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def train(
    shape: Shape, stream: np.ndarray, specials: dict[str, int], seed: int, log_every: int
) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(seed)
    model = build_model(shape, specials)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=shape.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(stream.astype(np.int64))
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    model.train()
    window = 0.0
    for step in range(shape.steps):
        offsets = rng.integers(0, len(stream) - CONTEXT - 1, size=shape.batch)
        batch = torch.stack([data[o : o + CONTEXT + 1] for o in offsets])  # [batch, CONTEXT + 1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits  # [batch, CONTEXT, vocab]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == shape.steps:
            count = (step % log_every) + 1
            elapsed = time.perf_counter() - start
            tokens = (step + 1) * shape.batch * CONTEXT
            history.append({"step": step + 1, "loss": window / count, "tokens": tokens, "seconds": elapsed})
            print(
                f"{shape.name} step {step + 1}/{shape.steps} loss {window / count:.3f} "
                f"lr {lr_at(step, shape):.2e} {tokens / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
            window = 0.0
    model.eval()
    log = {
        "shape": asdict(shape),
        "parameters": params,
        "context": CONTEXT,
        "tokens_seen": shape.steps * shape.batch * CONTEXT,
        "training_tokens_available": len(stream),
        "final_train_loss": history[-1]["loss"],
        "seconds": time.perf_counter() - start,
        "seed": seed,
        "history": history,
    }
    return model, log


def save(model: Any, tok: Any, specials: SpecialTokens, ids: dict[str, int], out: Path, log: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"]
    ).save_pretrained(str(out))
    save_tokenizer(tok, out, specials, MAX_POSITIONS)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="models", help="parent folder of the two model folders")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply training steps (a quick trial: 0.02)")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train_files, held_out = split()
    print(f"{len(train_files)} training files, {len(held_out)} held out", flush=True)
    texts, size = [], 0
    for f in train_files:  # the tokenizer's sample: the first files in sorted order up to the budget
        texts.append(read(f))
        size += len(texts[-1])
        if size >= TOKENIZER_BYTES:
            break
    specials = SpecialTokens()
    tok = train_bpe(VOCAB, args.seed, TOKENIZER_BYTES, specials, texts=texts)
    ids = {
        "bos": tok.token_to_id(specials.bos), "eos": tok.token_to_id(specials.eos),
        "pad": tok.token_to_id(specials.pad), "im_end": tok.token_to_id(specials.im_end),
    }  # fmt: skip
    stream = token_stream(tok, train_files)
    print(f"tokenizer: {tok.get_vocab_size()} entries; training stream {len(stream):,} tokens", flush=True)
    env = {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads}
    for shape in (TARGET, DRAFT):
        shape = Shape(**{**asdict(shape), "steps": max(1, round(shape.steps * args.scale))})
        model, log = train(shape, stream, ids, args.seed, args.log_every)
        log.update(
            {
                "environment": env,
                "data": "CPython standard library sources, training split (benchmarks/demo_models.py for held-out)",
                "command": "python scripts/train_demo_models.py " + " ".join(sys.argv[1:]),
            }
        )
        save(model, tok, specials, ids, Path(args.out) / shape.name, log)
        print(f"wrote {Path(args.out) / shape.name} ({log['parameters']:,} parameters)", flush=True)


if __name__ == "__main__":
    main()
