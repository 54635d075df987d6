"""Forward benchmark: tokenmill's paged forward beside transformers' own forward and cache.

tokenmill runs as its engine does by default (`auto`: the native attention backend, layer ops and
linear kernel where they build, tuned, and the decoder layers fused into one native call for
decode steps; `--attention-backend torch --layer-ops torch --linear-backend torch` for the reference
path).
Measures, on the `small` peer model (shared/PEERS.md) in float32 and bfloat16, in one run with the
two engines interleaved (median of repeats, spread shown):
- prefill tokens/s for a 512-token prompt (logits for the last token only, as an engine needs);
- decode step time at batch 1, 4, 8 and 32 (context 128 tokens per sequence; each sample times 16
  steps after its prefill and WARM_STEPS untimed steps);
- each decode step against this machine's memory-bandwidth floor: weight bytes read per step
  (every weight but the embedding table, of which a step reads only a few rows) / measured read
  bandwidth (a streaming sum over 512 MiB); and against the same bytes at the bandwidth torch's
  fp32 GEMV reaches on a 512 MiB matrix, which separates kernel limits from tokenmill's overhead.

Summaries (median, min, max of the interleaved repeats) and the per-repeat ratios come from
`tokenmill.bench.metrics.spread`, as in every `tokenmill bench` result. Both sides run in one
process with glibc's malloc thresholds raised (`keep_freed_memory`, as the
engine sets them on CPU), so neither pays page faults for its per-step temporaries.

`--model DIR` measures another model folder instead (SmolLM2: `--model models/smollm2-135m-instruct`).

Usage: python benchmarks/forward.py [--repeats 3] [--threads 2] [--model DIR] [--out benchmarks/results/forward.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from common import RESULTS, ensure_model

from tokenmill.bench.metrics import spread
from tokenmill.kernels.autotune import Autotuner, default_cache_path
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import load_model
from tokenmill.quant.cpu_dense import get_dense_linear_method
from tokenmill.runner.cpu_memory import keep_freed_memory
from tokenmill.runner.model_builder import prepare_native

BLOCK = 16
PROMPT = 512
CONTEXT = 128
BATCHES = (1, 4, 8, 32)
DECODE_STEPS = 16
# untimed decode steps between a sample's prefill and its timed steps: a decode step is measured after
# decode steps, as in serving, not with a prefill's caches (a long prefill just before the timed steps
# leaves the caches holding its activations, and makes the decode figures vary from run to run)
WARM_STEPS = 4


def _bytes_per_s(fn: Callable[[], object], nbytes: int, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def read_bandwidth() -> dict[str, float]:
    """Bytes/s reading 512 MiB (far past the caches): a streaming sum, the machine's read limit,
    and an fp32 GEMV (x @ W.T, W [32768, 4096]), the best torch's matrix-vector kernel does."""
    x = torch.randn(128 * 1024 * 1024)
    w, v = x.view(32768, 4096), torch.randn(1, 4096)
    return {
        "stream_sum": _bytes_per_s(x.sum, x.numel() * 4),
        "gemv_fp32": _bytes_per_s(lambda: torch.nn.functional.linear(v, w), w.numel() * 4),
    }


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if not model.config.tie_word_embeddings:  # a step reads a few rows of the table, not the table
        total -= embed.numel() * embed.element_size()
    return total


class Tokenmill:
    name = "tokenmill"

    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype,
        backend: str = "auto",
        ops: str = "auto",
        linear: str = "auto",
        fused: bool = True,
    ) -> None:
        self.backend = get_attention_backend(backend)  # the engine's defaults: native where it builds
        method = get_dense_linear_method(linear)
        self.model = load_model(folder, dtype=dtype, backend=self.backend, ops=get_layer_ops(ops), linear_method=method)
        tuner = Autotuner(torch.device("cpu"), default_cache_path())
        prepare_native(
            self.model, tuner, max(BATCHES), PROMPT, tune=linear == "auto", fused=fused
        )  # as the engine does
        self.linear = type(method).__name__ if linear != "auto" else f"auto ({type(method).__name__}, tuned)"
        self.dtype = dtype

    def _fresh(self, batch: int, tokens: int) -> None:
        per_seq = -(-(tokens + WARM_STEPS + DECODE_STEPS + 1) // BLOCK)
        cfg = self.model.config
        self.caches = allocate_kv_cache(
            self.backend, cfg.num_layers, batch * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        self.tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def _run(self, ids: torch.Tensor, query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        md = self.backend.build_metadata(query_lens, seq_lens, self.tables, BLOCK)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
        hidden = self.model(ids, positions, self.caches, md)
        last = torch.tensor(list(itertools.accumulate(query_lens))) - 1  # each sequence's last token
        return self.model.compute_logits(hidden[last])

    def prefill(self, prompt: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            self._fresh(1, len(prompt))
            self._run(prompt, [len(prompt)], [len(prompt)])

        return run

    def decode(self, prompts: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
        batch, ctx = prompts.shape
        state = {"len": ctx}

        def setup() -> None:
            self._fresh(batch, ctx)
            self._run(prompts.flatten(), [ctx] * batch, [ctx] * batch)
            state["len"] = ctx

        def step() -> None:
            state["len"] += 1
            self._run(torch.zeros(batch, dtype=torch.int64), [1] * batch, [state["len"]] * batch)

        return setup, step


class HF:
    name = "transformers"

    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    def prefill(self, prompt: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            self.model(prompt[None], use_cache=True, logits_to_keep=1)

        return run

    def decode(self, prompts: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
        batch = prompts.shape[0]
        state: dict[str, object] = {}

        def setup() -> None:
            out = self.model(prompts, use_cache=True, logits_to_keep=1)
            state["cache"] = out.past_key_values

        def step() -> None:
            out = self.model(
                torch.zeros(batch, 1, dtype=torch.int64),
                past_key_values=state["cache"],
                use_cache=True,
                logits_to_keep=1,
            )
            state["cache"] = out.past_key_values

        return setup, step


def resolved_backend_name(name: str) -> str:
    return get_attention_backend(name).name  # auto resolves to what runs


def time_once(setup: Callable[[], None] | None, fn: Callable[[], None], calls: int) -> float:
    """Seconds per call of `fn`, after an untimed `setup` and, with one, WARM_STEPS untimed calls."""
    if setup is not None:
        setup()
        for _ in range(WARM_STEPS):
            fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def print_row(label: str, key: str, ratio: dict[str, Any], *sides: dict[str, Any]) -> None:
    cells = [f"{d[key]['median']:9.1f} [{d[key]['min']:.1f}-{d[key]['max']:.1f}]" for d in sides]
    spread_text = f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]"
    print(f"{label:28}{cells[0]:>22}{cells[1]:>22}  {spread_text}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "forward.json"))
    parser.add_argument("--model", default=None, help="a model folder (default: the small peer model, built once)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--layer-ops", default="auto")
    parser.add_argument("--linear-backend", default="auto")
    parser.add_argument("--no-fused-decode", action="store_true", help="run the decoder layers as modules")
    return parser.parse_args()


def run_header(args: argparse.Namespace, folder: Path, bandwidths: dict[str, float]) -> dict[str, object]:
    """The result's description of the run: versions, machine, settings, the measured read bandwidths."""
    return {
        "model": str(folder) if args.model else "make-model --arch llama --size small --seed 0 (54.9M parameters)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "attention_backend": resolved_backend_name(args.attention_backend),
        "layer_ops": get_layer_ops(args.layer_ops).name,
        "repeats": args.repeats,
        "read_bandwidth_GBps": {k: v / 1e9 for k, v in bandwidths.items()},
        "dtypes": {},
    }


def collect_samples(engines: list[Any], vocab: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per prefill and per decode step at each batch, engine by engine, the engines interleaved."""
    prompt = torch.randint(0, vocab, (PROMPT,))
    prefill = {e.name: e.prefill(prompt) for e in engines}
    decodes = {b: {e.name: e.decode(torch.randint(0, vocab, (b, CONTEXT))) for e in engines} for b in BATCHES}
    for e in engines:  # warm-up
        prefill[e.name]()
        time_once(*decodes[1][e.name], calls=2)
    samples: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
    for _ in range(repeats):  # interleaved: each repeat runs every case on both engines
        for e in engines:
            s = samples[e.name]
            s.setdefault("prefill_s", []).append(time_once(None, prefill[e.name], calls=1))
            for b in BATCHES:
                s.setdefault(f"decode_b{b}_s", []).append(time_once(*decodes[b][e.name], calls=DECODE_STEPS))
    return samples


def summarize_dtype(
    samples: dict[str, dict[str, list[float]]], weight_bytes: int, bandwidths: dict[str, float]
) -> dict[str, Any]:
    """One dtype's entry: each side's spreads, the floors, and the per-repeat ratios between the sides."""
    floor = weight_bytes / bandwidths["stream_sum"]
    gemv_floor = weight_bytes / bandwidths["gemv_fp32"]
    entry: dict[str, Any] = {
        "weight_bytes_per_decode_step": weight_bytes,
        "floor_s": floor,
        "gemv_fp32_floor_s": gemv_floor,
    }
    for name, s in samples.items():
        entry[name] = {
            "prefill_tokens_per_s": spread([PROMPT / t for t in s["prefill_s"]]),
            **{f"decode_step_ms_b{b}": spread([t * 1e3 for t in s[f"decode_b{b}_s"]]) for b in BATCHES},
        }
    tm = entry["tokenmill"]
    tms, hfs = samples["tokenmill"], samples["transformers"]
    ratios: dict[str, Any] = {  # per repeat (the two sides ran side by side), then spread
        "prefill_speedup": spread([h / t for t, h in zip(tms["prefill_s"], hfs["prefill_s"], strict=True)])
    }
    for b in BATCHES:
        key = f"decode_step_ms_b{b}"
        pairs = zip(tms[f"decode_b{b}_s"], hfs[f"decode_b{b}_s"], strict=True)
        ratios[f"decode_b{b}_speedup"] = spread([h / t for t, h in pairs])
        ratios[f"decode_b{b}_vs_floor"] = tm[key]["median"] / (floor * 1e3)
        ratios[f"decode_b{b}_vs_gemv_fp32_floor"] = tm[key]["median"] / (gemv_floor * 1e3)
        ratios[f"decode_b{b}_vs_b1"] = spread(
            [t / one for t, one in zip(tms[f"decode_b{b}_s"], tms["decode_b1_s"], strict=True)]
        )
    entry["ratios"] = ratios
    return entry


def print_dtype(dtype_name: str, entry: dict[str, Any]) -> None:
    """The table of one dtype: each measurement on both sides and their ratio, then the floors."""
    tm, hf, ratios = entry["tokenmill"], entry["transformers"], entry["ratios"]
    print(
        f"\n{dtype_name}: weights read per decode step {entry['weight_bytes_per_decode_step'] / 1e6:.0f} MB, floor "
        f"{entry['floor_s'] * 1e3:.2f} ms (at fp32 GEMV bandwidth {entry['gemv_fp32_floor_s'] * 1e3:.2f} ms)"
    )
    print(f"{'':28}{'tokenmill':>22}{'transformers':>22}  ratio (transformers time / tokenmill's)")

    print_row("prefill 512, tokens/s", "prefill_tokens_per_s", ratios["prefill_speedup"], tm, hf)
    for b in BATCHES:
        print_row(f"decode step b={b}, ms", f"decode_step_ms_b{b}", ratios[f"decode_b{b}_speedup"], tm, hf)
    b4 = ratios["decode_b4_vs_b1"]
    print(
        f"decode b=1: {ratios['decode_b1_vs_floor']:.2f}x the floor, "
        f"{ratios['decode_b1_vs_gemv_fp32_floor']:.2f}x the fp32-GEMV floor; a step at b=4 costs "
        f"{b4['median']:.2f}x [{b4['min']:.2f}-{b4['max']:.2f}] one at b=1"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    keep_freed_memory()  # as tokenmill's engine does on CPU; it applies to both sides of the comparison
    folder = Path(args.model) if args.model else ensure_model()
    bandwidths = read_bandwidth()
    print(
        f"read bandwidth ({args.threads} threads): streaming {bandwidths['stream_sum'] / 1e9:.1f} GB/s, "
        f"fp32 GEMV {bandwidths['gemv_fp32'] / 1e9:.1f} GB/s"
    )
    result = run_header(args, folder, bandwidths)
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            tokenmill = Tokenmill(
                folder, dtype, args.attention_backend, args.layer_ops, args.linear_backend, not args.no_fused_decode
            )
            result["fused_decode"] = tokenmill.model.fused_decode is not None
            result["linear_backend"] = tokenmill.linear
            engines = [tokenmill, HF(folder, dtype)]
            samples = collect_samples(engines, tokenmill.model.config.vocab_size, args.repeats)
            entry = summarize_dtype(samples, decode_weight_bytes(tokenmill.model), bandwidths)
            result["dtypes"][dtype_name] = entry  # type: ignore[index]
            print_dtype(dtype_name, entry)
            del engines, tokenmill
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
