"""Quantization benchmark: decode speed of int8, int4 and W8A8 against the unquantized model in this
machine's fastest dtype, at batch 1, 8 and 32, and the quality each costs.

Speed, per model (the `small` peer model, and SmolLM2-135M-Instruct where `make serve` set it up):
`tokenmill bench offline --compare quantization=none quantization=int8 quantization=int4
quantization=w8a8`, the variants interleaved in each of 3 repeats, one dtype for all: the one
`--dtype fastest` picks for the unquantized model on this CPU (measured at start, logged). Workload:
`random`, 128-token prompts, 128 new tokens (EOS ignored), greedy, at concurrency 1 (4 requests),
8 (16) and 32 (64). Reported per variant and concurrency: output tokens/s, TPOT and TTFT medians,
and the ratios against `none` (median and spread of the repeats).
Quality: `tokenmill eval-quant` of each method, and of int4 with the output projection in int8, on
the demo model (bfloat16, trained here) and on SmolLM2 (its layers are dequantized Q4_1 from the
GGUF file: int4 in groups of 32 lands on that grid; its tied embedding / head was Q8_0), 16 windows of
512 held-out tokens; and the KV tokens the default budget holds for the peer model in bfloat16 with
a bfloat16 and an int8 KV cache. `--models ""` runs the quality and KV parts alone.
Writes benchmarks/results/quantization.json and prints its table in benchmarks/RESULTS.md.

Usage: python benchmarks/quantization.py [--repeats 3] [--models small,smollm2] [--skip-quality]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, ensure_model
from common import bench as run_bench

METHODS = ("none", "int8", "int4", "w8a8")
CONCURRENCY = {1: 4, 8: 16, 32: 64}  # concurrency -> requests
SMOLLM2 = ROOT.parent / "models" / "smollm2-135m-instruct"
DEMO = ROOT.parent / "models" / "tokenmill-demo"


def fastest_dtype(model: Path) -> str:
    """The dtype `--dtype fastest` picks for the unquantized model here (the engine's own measurement)."""
    from tokenmill import LLM

    llm = LLM(str(model), dtype="fastest", max_num_seqs=32)
    return str(llm.engine.core.worker.dtype).removeprefix("torch.")


def speed(model: Path, dtype: str, repeats: int, tag: str) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for conc, requests in CONCURRENCY.items():
        out = RESULTS / "quantization" / f"{tag}_c{conc}.json"  # the raw runs (not in git: ~2 MB each)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = run_bench(
            "offline", str(model), "--workload", "random", "--num-requests", str(requests),
            "--input-len", "128", "--output-len", "128", "--max-concurrency", str(conc), "--seed", "0",
            "--compare", *(f"quantization={m}" for m in METHODS), "--repeats", str(repeats),
            "--dtype", dtype, "--max-num-seqs", "32", "--no-progress", "--out", str(out),
        )  # fmt: skip
        a, g = result.aggregate, result.gains
        rows[f"c{conc}"] = {
            m: {
                "output_tok_per_s": a[f"quantization={m}"]["output_throughput"],
                "tpot_ms": a[f"quantization={m}"]["tpot.median"],
                "ttft_ms": a[f"quantization={m}"]["ttft.median"],
                **(
                    {"over_none": g[f"quantization={m} over quantization=none"]["output_throughput"]}
                    if m != "none"
                    else {}
                ),
            }
            for m in METHODS
        }
    return rows


def quality(model: Path) -> dict[str, Any]:
    from tokenmill.eval.quant_eval import evaluate
    from tokenmill.quant.quantize import QuantSpec

    out = {}
    specs = {m: QuantSpec(m) for m in METHODS[1:]} | {"int4_head_int8": QuantSpec("int4", head="int8")}
    for name, spec in specs.items():
        report = evaluate(str(model), spec, "auto" if model == DEMO else "bfloat16", None, 16, 512)
        print(report.render(), flush=True)
        out[name] = report.to_json()
    return out


def int4_grid_error(model: Path) -> dict[str, Any]:
    """Relative RMS error of int4 in groups of 32 on two of the model's tensors, from its float32 file
    and from a bfloat16 copy: whether its weights already sit on that grid (SmolLM2's layers were Q4_1)."""
    import torch
    from safetensors import safe_open

    from tokenmill.quant.quantize import dequantize_int4, quantize_int4

    out: dict[str, Any] = {}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in ("model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight"):
            w = f.get_tensor(name).float()
            for src, x in (("float32", w), ("bfloat16", w.bfloat16().float())):
                err = dequantize_int4(quantize_int4(x, 32), torch.float32) - w
                out[f"{name} from {src}"] = float(err.pow(2).mean().sqrt() / w.pow(2).mean().sqrt())
    return out


def kv_capacity(model: Path) -> dict[str, Any]:
    """KV tokens the default budget holds for the model in bfloat16, with its own and an int8 cache
    (the engine's own arithmetic: `llm.stats().kv_tokens`)."""
    from tokenmill import LLM

    tokens = {kv: LLM(str(model), dtype="bfloat16", kv_cache_dtype=kv).stats().kv_tokens for kv in ("auto", "int8")}
    return {"bfloat16": tokens["auto"], "int8": tokens["int8"], "ratio": tokens["int8"] / tokens["auto"]}


def median(stats: dict[str, Any]) -> float:
    return float(stats["median"]) if isinstance(stats, dict) else float(stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="small,smollm2")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "quantization.json"))
    args = parser.parse_args()
    models = {"small": ensure_model(), "smollm2": SMOLLM2}
    result: dict[str, Any] = {"speed": {}, "quality": {}, "kv_cache_int8": {}}
    for name in filter(None, args.models.split(",")):
        folder = models[name]
        if not (folder / "config.json").is_file():
            print(f"skipping {name}: {folder} is not set up (make serve fetches it)")
            continue
        dtype = fastest_dtype(folder)
        print(f"{name}: --dtype fastest picks {dtype}", flush=True)
        result["speed"][name] = {"dtype": dtype, "rows": speed(folder, dtype, args.repeats, name)}
    if not args.skip_quality:
        for name, folder in (("demo", DEMO), ("smollm2", SMOLLM2)):
            if (folder / "config.json").is_file():
                result["quality"][name] = quality(folder)
        if (SMOLLM2 / "config.json").is_file():
            result["int4_grid_error"] = {"smollm2": int4_grid_error(SMOLLM2)}
            print(f"int4 g32 relative error on SmolLM2's tensors: {result['int4_grid_error']}", flush=True)
        result["kv_cache_int8"]["small"] = kv_capacity(models["small"])
        print(f"int8 KV cache, peer model in bfloat16: {result['kv_cache_int8']['small']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, entry in result["speed"].items():
        print(f"\n{name} ({entry['dtype']}): output tok/s, and the ratio over none (median [min-max] of the repeats)")
        for conc, row in entry["rows"].items():
            cells = []
            for m in METHODS:
                cell_text = f"{m} {median(row[m]['output_tok_per_s']):.0f}"
                if m != "none":
                    r = row[m]["over_none"]
                    cell_text += f" ({r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}])"
                cells.append(cell_text)
            tpot = ", ".join(f"{m} {median(row[m]['tpot_ms']):.2f}" for m in METHODS)
            print(f"  {conc}: " + "; ".join(cells) + f"\n       TPOT ms: {tpot}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
