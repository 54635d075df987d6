"""What a JSON schema costs: output tokens/s with and without one, at batch 1 and 32, side by side.

SmolLM2-135M-Instruct (bfloat16, `LLM.generate`, one process), a chat prompt asking for a list of
people as JSON. With the schema: an object holding an array of at least 40 `{"name", "age", "city"}`
objects, so that no request can finish its structure within the 64 tokens each generates (every one
runs exactly 64, finish "length", as the plain ones do with EOS ignored). The two interleaved in each
of 3 repeats (after a warm-up of each); tokens/s = generated tokens / wall time of the `generate`
call; the grammar's own time (masks computed and applied) from the engine's counters. Also the
compile time of the schema (a fresh compiler) and of its cached copy. Writes
benchmarks/results/structured.json.

Usage: python benchmarks/structured.py [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import RESULTS

from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 64
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 40}},
    "required": ["people"],
    "additionalProperties": False,
}


def run(llm: LLM, prompt: list[int], batch: int, structured: bool) -> tuple[float, float]:
    """(tokens/s, mask seconds) of one generate call of `batch` requests."""
    spec = {"json": SCHEMA} if structured else None
    params = SamplingParams(max_tokens=TOKENS, temperature=0.7, seed=0, ignore_eos=True, structured_outputs=spec)
    grammar = llm.engine.core.worker.runner.batch.grammar
    masked = grammar.mask_seconds if grammar is not None else 0.0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == batch * TOKENS, f"expected {batch * TOKENS} tokens, got {tokens}"
    return tokens / wall, (grammar.mask_seconds if grammar is not None else 0.0) - masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", max_model_len=512, max_num_seqs=32)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List forty people (name, age, city) as JSON."}]
    )
    tokenizer = Tokenizer(args.model)
    compiler = GrammarCompiler(tokenizer, llm.engine.model_config.vocab_size)
    _ = compiler.tokenizer  # built once per process: not a schema's cost
    start = time.perf_counter()
    compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    cached_ms = (time.perf_counter() - start) * 1e3
    samples: dict[str, list[float]] = {}
    for batch in (1, 32):
        for structured in (False, True):  # warm-up
            run(llm, prompt, batch, structured)
        for _ in range(args.repeats):
            for structured in (False, True):
                rate, masked = run(llm, prompt, batch, structured)
                key = f"b{batch}_{'schema' if structured else 'plain'}"
                samples.setdefault(key, []).append(rate)
                if structured:
                    samples.setdefault(f"b{batch}_mask_ms_per_step", []).append(masked * 1e3 / TOKENS)

    def spread(values: list[float]) -> dict[str, object]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}

    result = {
        "model": Path(args.model).name,
        "dtype": "bfloat16",
        "tokens_per_request": TOKENS,
        "repeats": args.repeats,
        "schema_compile_ms": compile_ms,
        "schema_cached_ms": cached_ms,
        "tokens_per_s": {k: spread(v) for k, v in samples.items() if "mask" not in k},
        "mask_ms_per_step": {k: spread(v) for k, v in samples.items() if "mask" in k},
        "schema_over_plain": {
            f"b{b}": spread([s / p for s, p in zip(samples[f"b{b}_schema"], samples[f"b{b}_plain"], strict=True)])
            for b in (1, 32)
        },
    }
    path = RESULTS / "structured.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    print(f"schema compile {compile_ms:.1f} ms, cached {cached_ms:.3f} ms")
    for b in (1, 32):
        p, s, r = samples[f"b{b}_plain"], samples[f"b{b}_schema"], result["schema_over_plain"][f"b{b}"]
        mask = statistics.median(samples[f"b{b}_mask_ms_per_step"])
        print(
            f"batch {b}: plain {statistics.median(p):.0f} [{min(p):.0f}-{max(p):.0f}] tok/s, schema "
            f"{statistics.median(s):.0f} [{min(s):.0f}-{max(s):.0f}] tok/s, ratio {r['median']:.3f} "
            f"[{r['min']:.3f}-{r['max']:.3f}], masks {mask:.2f} ms a step"
        )


if __name__ == "__main__":
    main()
