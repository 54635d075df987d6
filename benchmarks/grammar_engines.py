"""llguidance against xgrammar on this CPU: install size, a schema's compile time, the mask's time.

SmolLM2-135M-Instruct's tokenizer (49k tokens), `structured.py`'s JSON schema, compact JSON on both.
Per engine: its installed size, the tokenizer set-up, the first compile of the schema and a cached
one, and the next-token mask of 1 and of 32 matchers that have consumed the same 9 tokens (20 timed
passes, the median pass). xgrammar is not a tokenmill dependency (its wheel requires torch and, on
Linux x86_64, triton): install it beside, without letting pip resolve those, e.g.
`pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi` and run with
`PYTHONPATH=/tmp/xg`; without it only llguidance is measured. Writes benchmarks/results/grammar_engines.json.

Usage: python benchmarks/grammar_engines.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS
from structured import SCHEMA

from tokenmill.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PREFIX = '{"people":[{"name":"Al'  # the matchers' state when their mask is timed


def size_mb(module: Any) -> float:
    folder = Path(module.__file__).parent
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def mask_ms(fill: Any, batch: int) -> float:
    passes = []
    for _ in range(20):
        start = time.perf_counter()
        for j in range(batch):
            fill(j)
        passes.append((time.perf_counter() - start) * 1e3)
    return statistics.median(passes)


def llguidance_figures(tokenizer: Tokenizer, vocab: int, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf

    out = {"installed_mb": size_mb(llguidance)}
    holder: dict[str, Any] = {}
    out["tokenizer_ms"] = timed(lambda: holder.update(tok=llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    out["compile_ms"] = timed(lambda: holder.update(m=llguidance.LLMatcher(holder["tok"], grammar)))
    out["cached_ms"] = timed(lambda: holder["m"].deep_copy())  # what GrammarCompiler does for a cached spec
    for batch in (1, 32):
        matchers = [holder["m"].deep_copy() for _ in range(batch)]
        for m in matchers:
            m.consume_tokens(ids)
        mask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
        out[f"mask_ms_b{batch}"] = mask_ms(
            lambda j, ms=matchers, mk=mask: ms[j].unsafe_compute_mask_ptr(mk[j].data_ptr(), mk.shape[1] * 4), batch
        )
    return out


def xgrammar_figures(tokenizer: Tokenizer, vocab: int, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    out = {"installed_mb": size_mb(xgr)}
    holder: dict[str, Any] = {}
    out["tokenizer_ms"] = timed(
        lambda: holder.update(info=xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab))
    )
    compiler = xgr.GrammarCompiler(holder["info"], max_threads=1)
    text = json.dumps(SCHEMA)
    out["compile_ms"] = timed(lambda: holder.update(g=compiler.compile_json_schema(text, any_whitespace=False)))
    out["cached_ms"] = timed(lambda: compiler.compile_json_schema(text, any_whitespace=False))
    for batch in (1, 32):
        matchers = [xgr.GrammarMatcher(holder["g"]) for _ in range(batch)]
        for m in matchers:
            for i in ids:
                m.accept_token(i)
        mask = xgr.allocate_token_bitmask(batch, vocab)
        out[f"mask_ms_b{batch}"] = mask_ms(lambda j, ms=matchers, mk=mask: ms[j].fill_next_token_bitmask(mk, j), batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    args = parser.parse_args()
    tokenizer = Tokenizer(args.model)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ids = tokenizer.encode(PREFIX, add_special_tokens=False)
    result: dict[str, Any] = {"model": Path(args.model).name, "vocab_size": vocab, "prefix_tokens": len(ids)}
    result["llguidance"] = llguidance_figures(tokenizer, vocab, ids)
    try:
        result["xgrammar"] = xgrammar_figures(tokenizer, vocab, ids)
    except ImportError as e:
        result["xgrammar"] = f"not measured: {e}"
    path = RESULTS / "grammar_engines.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    for name in ("llguidance", "xgrammar"):
        figures = result[name]
        line = ", ".join(f"{k} {v:.3f}" for k, v in figures.items()) if isinstance(figures, dict) else figures
        print(f"{name}: {line}")


if __name__ == "__main__":
    main()
