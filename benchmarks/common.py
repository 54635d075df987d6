"""Shared by the benchmark scripts: the `small` peer model (built once, offline) and a call into
`tokenmill bench`, whose result file every figure in benchmarks/RESULTS.md is read from."""

from __future__ import annotations

from pathlib import Path

from tokenmill.bench.records import BenchResult, read_result
from tokenmill.cli import main as tokenmill

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
MODEL_DIR = ROOT / ".models" / "small-llama"
MODEL = "make-model --arch llama --size small --seed 0 (54.9M parameters, random weights)"


def ensure_model() -> Path:
    from tokenmill.tools.make_model import make_model

    if not (MODEL_DIR / "config.json").is_file():
        make_model("llama", "small", MODEL_DIR, seed=0)
    return MODEL_DIR


def bench(*argv: str) -> BenchResult:
    """Run `tokenmill bench ...` (it must write --out) and read its result back."""
    args = ["bench", *argv]
    print("$ tokenmill " + " ".join(args), flush=True)
    if tokenmill(args) != 0:
        raise SystemExit(f"tokenmill bench failed: {' '.join(args)}")
    return read_result(Path(args[args.index("--out") + 1]))


def plot(result_file: Path, out_dir: Path) -> None:
    if tokenmill(["bench", "plot", str(result_file), "--out", str(out_dir)]) != 0:
        raise SystemExit(f"tokenmill bench plot failed on {result_file}")


def cell(stats: dict[str, float], fmt: str = "{:.2f}") -> str:
    """'median [min–max]' as benchmarks/RESULTS.md quotes it."""
    return f"{fmt.format(stats['median'])} [{fmt.format(stats['min'])}–{fmt.format(stats['max'])}]"


def kv_token_bytes(model: Path, dtype: str) -> int:
    """KV cache bytes a token takes in `model` (K and V of every layer) in `dtype`."""
    import json

    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)
