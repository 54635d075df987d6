"""A K-quant GGUF file kept in its blocks against the same file dequantized at load: memory, load time,
decode speed. The file is `--gguf` (the peers' 1.1B Q4_K_M, `/tmp/peers/gguf/mid-llama-q4_k_m.gguf`, when
there), else a synthetic one written once: TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 / 4
heads, FFN 5632) with the demo model's 8192-token vocabulary, llama.cpp's Q4_K_M mix of random valid
blocks (v, down and the output projection Q6_K, the rest Q4_K), about 600 MB.

Measured, each load in a process of its own: the resident memory the load adds (VmRSS after
`load_model` and the checkpoint dropped, as the engine drops it, minus before; the KV cache is not
part of it: the engine sizes that apart, `kv_cache_memory`) over the file's tensor bytes (also with the
checkpoint still open), and the load's seconds, for `quantization`
auto (kept) and none (every matrix dequantized to bfloat16 by `gguf` at load). Then decode: both
models (bfloat16, the native layer ops and attention, the modules' path) in one process, one sequence
of a 16-token prompt and `--tokens` greedy steps, the two interleaved in each of `--repeats` repeats;
steps (tokens) a second, median [min-max]. Writes benchmarks/results/gguf_kquants.json (or `--out`).

Usage: python benchmarks/gguf_kquants.py [--gguf FILE] [--repeats 3] [--tokens 32] [--out gguf_kquants.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PEERS = Path("/tmp/peers/gguf/mid-llama-q4_k_m.gguf")
SYNTHETIC = Path("/tmp/tokenmill-synthetic-1.1b-q4_k_m.gguf")  # (written once, not in git)
SHAPE = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def write_synthetic(out: Path) -> None:
    """The synthetic Q4_K_M file (module docstring), tokenizer and metadata as tests/gguf_files.py
    writes them for the demo model."""
    import gguf

    sys.path.insert(0, str(ROOT.parent))
    from tests.gguf_files import raw_k_quant_rows, write_gguf
    from tokenmill.engine_args import DEMO_MODEL

    # the demo model's metadata and tokenizer, written to a scratch file, then copied with new tensors
    scratch = out.with_suffix(".demo.gguf")
    write_gguf(DEMO_MODEL, scratch, "F32")
    reader = gguf.GGUFReader(str(scratch))
    h, n, ffn, vocab = SHAPE["hidden"], SHAPE["layers"], SHAPE["ffn"], 8192
    w = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        sizes = {
            "llama.block_count": n,
            "llama.embedding_length": h,
            "llama.feed_forward_length": ffn,
            "llama.attention.head_count": SHAPE["heads"],
            "llama.attention.head_count_kv": SHAPE["kv_heads"],
            "llama.attention.key_length": h // SHAPE["heads"],
            "llama.attention.value_length": h // SHAPE["heads"],
            "llama.rope.dimension_count": h // SHAPE["heads"],
        }
        value = sizes.get(name, value)
        vtype = field.types[0]
        w.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    kv = SHAPE["kv_heads"] * h // SHAPE["heads"]
    matrices = {"token_embd.weight": (vocab, h, "Q4_K"), "output.weight": (vocab, h, "Q6_K")}
    for i in range(n):
        for name, shape, kind in (
            ("attn_q", (h, h), "Q4_K"),
            ("attn_k", (kv, h), "Q4_K"),
            ("attn_v", (kv, h), "Q6_K"),
            ("attn_output", (h, h), "Q4_K"),
            ("ffn_gate", (ffn, h), "Q4_K"),
            ("ffn_up", (ffn, h), "Q4_K"),
            ("ffn_down", (h, ffn), "Q6_K"),
        ):
            matrices[f"blk.{i}.{name}.weight"] = (*shape, kind)
    for name, (rows, cols, kind) in matrices.items():
        w.add_tensor(name, raw_k_quant_rows(rows, cols, kind, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    for i in range(n):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    scratch.unlink()


def measure_load(path: str, quantization: str) -> dict[str, float]:
    """(In a child process) the load's added resident memory and seconds."""
    import torch

    from tokenmill.kernels.cpu_build import load_cpu_kernels
    from tokenmill.models.gguf_checkpoint import GGUFCheckpoint
    from tokenmill.models.loader import gguf_layer_types, load_model
    from tokenmill.quant.config import QuantSettings, build_quant_config

    kernels = load_cpu_kernels()  # (built or loaded before the measurement)
    assert kernels is not None
    torch.set_num_threads(torch.get_num_threads())
    before = rss_bytes()
    start = time.perf_counter()
    checkpoint = GGUFCheckpoint(path)
    quant = build_quant_config(
        QuantSettings(quantization), device=torch.device("cpu"), dtype=torch.bfloat16,
        dense_backend=lambda: "torch", stored=None, gguf_types=gguf_layer_types(checkpoint),
    )  # fmt: skip
    model = load_model(checkpoint, dtype=torch.bfloat16, quant=quant)
    seconds = time.perf_counter() - start
    open_grown = rss_bytes() - before
    file_bytes = checkpoint.tensor_bytes
    del checkpoint  # (as the engine drops it once the model is built)
    gc.collect()
    grown = rss_bytes() - before
    return {
        "load_s": seconds,
        "rss_growth_bytes": grown,
        "file_tensor_bytes": file_bytes,
        "rss_over_file": grown / file_bytes,
        "rss_over_file_checkpoint_open": open_grown / file_bytes,
        "weight_bytes": model.weight_bytes(),
    }


def decode_rates(path: str, repeats: int, tokens: int) -> dict[str, list[float]]:
    """Decode steps of one sequence (a 16-token prompt, then `tokens` greedy steps of one token) on the
    model loaded each way, bfloat16, native layer ops and attention; the two interleaved per repeat."""
    import torch

    sys.path.insert(0, str(ROOT.parent))
    from tests.helpers import PagedRunner
    from tokenmill.layers.backends import get_attention_backend
    from tokenmill.layers.ops import get_layer_ops
    from tokenmill.models.gguf_checkpoint import GGUFCheckpoint
    from tokenmill.models.loader import gguf_layer_types, load_model
    from tokenmill.quant.config import QuantSettings, build_quant_config

    checkpoint = GGUFCheckpoint(path)
    models = {}
    for q in ("auto", "none"):
        quant = build_quant_config(
            QuantSettings(q), device=torch.device("cpu"), dtype=torch.bfloat16,
            dense_backend=lambda: "cpu", stored=None, gguf_types=gguf_layer_types(checkpoint),
        )  # fmt: skip
        models[q] = load_model(
            checkpoint,
            dtype=torch.bfloat16,
            quant=quant,
            backend=get_attention_backend("cpu"),
            ops=get_layer_ops("cpu"),
        )
    blocks = (16 + tokens) // 16 + 2

    def run(model: torch.nn.Module, steps: int) -> float:
        runner = PagedRunner(model, num_blocks=blocks, block_size=16, block_order=list(range(blocks)))
        logits = runner.step({0: torch.arange(100, 116)})[0]
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                logits = runner.step({0: logits[-1:].argmax(-1)})[0]
        return steps / (time.perf_counter() - start)

    for model in models.values():
        run(model, 2)  # warm-up
    rates: dict[str, list[float]] = {q: [] for q in models}
    for _ in range(repeats):
        for q, model in models.items():
            rates[q].append(run(model, tokens))
    return rates


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    from tokenmill.kernels.cpu_build import cpu_flags

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="gguf_kquants.json", help="the JSON (a bare name: under results/)")
    parser.add_argument("--child", nargs=2, metavar=("FILE", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_load(*args.child)))
        return
    path = args.gguf or (PEERS if PEERS.is_file() else SYNTHETIC)
    if path == SYNTHETIC and not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path}")
        write_synthetic(path)
    loads: dict[str, list[dict[str, float]]] = {"auto": [], "none": []}
    for _ in range(args.repeats):
        for q in loads:
            run = subprocess.run(
                [sys.executable, __file__, "--child", str(path), q], capture_output=True, text=True, check=True
            )
            loads[q].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(q, loads[q][-1])
    rates = decode_rates(str(path), args.repeats, args.tokens)
    result = {
        "file": str(path),
        "synthetic": path == SYNTHETIC,
        "file_tensor_bytes": loads["auto"][0]["file_tensor_bytes"],
        "load": {
            q: {
                "load_s": summary([r["load_s"] for r in runs]),
                "rss_over_file": summary([r["rss_over_file"] for r in runs]),
                "rss_over_file_checkpoint_open": summary([r["rss_over_file_checkpoint_open"] for r in runs]),
                "weight_bytes": runs[0]["weight_bytes"],
            }
            for q, runs in loads.items()
        },
        "decode_tok_per_s": {q: summary(v) for q, v in rates.items()},
        "decode_auto_over_none": statistics.median(rates["auto"]) / statistics.median(rates["none"]),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "cpu_flags": cpu_flags(),
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out) if Path(args.out).parent != Path(".") else RESULTS / args.out
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
