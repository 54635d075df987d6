"""Which path `make serve` should serve SmolLM2-135M-Instruct by: its Q4_1 GGUF file kept quantized,
the same weights dequantized to bfloat16 at load, or the float32 folder `tokenmill convert` makes of it.

Per path, interleaved in each of `--repeats` rounds: the seconds from `tokenmill serve` to /health 200
(benchmarks/startup.py's `start_once`, a fresh cache folder with the native kernels' build linked in),
then `tokenmill bench offline` at 1 concurrent request (4 requests) and 8 (16): `random` workload,
128-token prompts, 64 new tokens (EOS ignored), greedy. Reports the median output tokens/s and ready
seconds per path and names the fastest at one request (the one-user case `make serve` is for; eight
is reported beside it). Writes benchmarks/results/serve_paths.json.

The real file (`models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by scripts/fetch_smollm2.py)
is measured where it is there. Where it is not (no network at set-up), a stand-in of its shape is
written offline (`--stand-in`, the default then): SmolLM2's layers (30, hidden 576, MLP 1536, 9 query /
3 KV heads, tied table) with random weights and the bundled demo model's tokenizer (so a vocabulary
of 8,192, not 49,152: a smaller output projection), its matrices Q4_1 and its table Q8_0 as in the
real file, by the tests' GGUF writer (tests/gguf_files.py). Speed depends on the shapes and types,
not on the weights' values.

The paths: the file kept quantized as `auto` serves it (`--gguf-layout auto`: Q4_1 in its blocks where the
CPU kind's rule says so), the same in bfloat16, its Q4_1 matrices read into int4 instead (`--gguf-layout
q8_0`), dequantized to bfloat16 at load, and the float32 folder.

Usage: python benchmarks/serve_paths.py [--repeats 3] [--gguf FILE] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT
from common import bench as run_bench
from startup import fresh_cache, start_once

from tokenmill.kernels.cpu_build import isa_cap_settings

REPO = ROOT.parent
REAL = REPO / "models" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STAND_IN = ROOT / ".models" / "smollm2-stand-in"
CONCURRENCY = {1: 4, 8: 16}  # concurrency -> requests
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def stand_in() -> Path:
    """A GGUF file of SmolLM2-135M-Instruct's shape and tensor types (module docstring), written once."""
    out = STAND_IN / "smollm2-stand-in.Q4_1.gguf"
    if out.is_file():
        return out
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from tests.gguf_files import write_gguf

    demo = REPO / "models" / "tokenmill-demo"
    folder = STAND_IN / "folder"
    cfg = json.loads((demo / "config.json").read_text()) | SMOLLM2_SHAPE
    config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "dtype")})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (demo / name).is_file():
            shutil.copy(demo / name, folder / name)
    return write_gguf(folder, out, lambda name, shape: "Q8_0" if name == "token_embd.weight" else "Q4_1")


def float32_folder(gguf: Path) -> Path:
    """The float32 folder `tokenmill convert` makes of `gguf` (what `make serve` served before), once."""
    folder = gguf.parent / (gguf.stem + "-float32")
    if not (folder / "config.json").is_file():
        from tokenmill.tools.gguf_convert import convert_gguf

        convert_gguf(gguf, folder, dtype="float32")
    return folder


def paths(gguf: Path) -> dict[str, tuple[Path, list[str]]]:
    """label -> (model, the settings it is served with)."""
    return {
        "Q4_1 kept (auto dtype)": (gguf, []),
        "Q4_1 kept, bfloat16": (gguf, ["--dtype", "bfloat16"]),
        "Q4_1 as int4 (q8_0 layout)": (gguf, ["--gguf-layout", "q8_0"]),
        "dequantized to bfloat16": (gguf, ["--dtype", "bfloat16", "--quantization", "none"]),
        "float32 folder": (float32_folder(gguf), ["--dtype", "float32"]),
    }


def decode_rate(model: Path, flags: list[str], conc: int, requests: int, out: Path) -> float:
    """Output tokens/s of one `tokenmill bench offline` run at `conc` concurrent requests."""
    result = run_bench(
        "offline", str(model), "--workload", "random", "--num-requests", str(requests), "--input-len", "128",
        "--output-len", "64", "--max-concurrency", str(conc), "--seed", "0",
        "--max-num-seqs", "32", "--no-progress", "--warmup", "1", "--out", str(out), *flags,
    )  # fmt: skip
    return float(next(iter(result.aggregate.values()))["output_throughput"]["median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", default=None, help="the Q4_1 file (default: SmolLM2's where set up, else a stand-in)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_paths.json")
    args = parser.parse_args()
    gguf = Path(args.gguf) if args.gguf else REAL if REAL.is_file() else stand_in()
    runs: dict[str, dict[str, list[float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="tokenmill-serve-paths-"))
    try:
        for r in range(args.repeats):
            for label, (model, flags) in paths(gguf).items():
                cache = fresh_cache(root, f"{r}-{len(runs.get(label, {}))}-{abs(hash(label))}")
                seconds, _ = start_once(model, flags, cache, 600.0)
                got = runs.setdefault(label, {})
                got.setdefault("ready_s", []).append(round(seconds, 2))
                for conc, requests in CONCURRENCY.items():
                    rate = decode_rate(model, flags, conc, requests, root / f"bench-{r}-{conc}.json")
                    got.setdefault(f"c{conc}_tok_s", []).append(round(rate, 1))
                print(label, {k: v[-1] for k, v in got.items()}, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {label: {k: statistics.median(v) for k, v in got.items()} for label, got in runs.items()}
    fastest = max(median, key=lambda label: median[label]["c1_tok_s"])
    result = {
        "what": "SmolLM2-135M-Instruct's serving paths: output tok/s at c=1 and c=8 (128-token prompts, "
        "64 new tokens), seconds to /health 200; median of the repeats, interleaved",
        "model": gguf.name,
        "isa_cap": isa_cap_settings(),
        "stand_in": gguf.parent == STAND_IN,
        "load_average": os.getloadavg(),
        "repeats": args.repeats,
        "median": median,
        "runs": runs,
        "fastest_at_c1": fastest,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'path':28} {'c=1 tok/s':>10} {'c=8 tok/s':>10} {'ready s':>8}")
    for label, m in median.items():
        print(f"{label:28} {m['c1_tok_s']:10.1f} {m['c8_tok_s']:10.1f} {m['ready_s']:8.1f}")
    print(f"fastest at one request: {fastest}")


if __name__ == "__main__":
    main()
