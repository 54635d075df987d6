"""The GPU check, one prepared run for a lent device (benchmarks/gpu/check.sh runs it, JSON to $OUT).

1. Correctness: the bundled demo model (models/tokenmill-demo, float32) decodes 16 greedy tokens with
   the torch reference on the CPU, and on the device with the Triton attention backend, eagerly and
   through CUDA graphs (runner/cuda_graphs.py): the prompt's logits within 1e-3 of the CPU's, the
   same tokens.
2. Against the hardware's limit (GPU only): a Llama-3-8B-shaped model with random bfloat16 weights,
   built on the device (no download), decoding at batch 1, 8 and 64 with 512 tokens of context each
   (the cache filled at random: the step reads it all the same), eagerly and replayed from a CUDA
   graph: the step's time against its weight bytes over the HBM bandwidth measured in the same run
   (a 4 GiB device-to-device copy); and a 2,048-token prompt's prefill (TTFT), its attention through
   SDPA (flash attention, the default) and through the paged kernel.
3. 2:4: the 8B shape's four projections (qkv, o, gate_up, down), pruned 2:4, as torch's
   semi-structured sparse tensors against dense, bfloat16, at 1 to 512 rows: the time of the four
   together each way (median of interleaved repeats), the speed-up, and the largest difference of
   the outputs.

DRY_RUN=1: everything on the CPU under Triton's interpreter, with tiny shapes and no timing (graphs
run eagerly over their buffers; 2:4 only pruned, no sparse kernels on a CPU), so that the script is
known to run before a device is lent. Imports no server module (the device has torch, triton and
transformers only); uses nothing newer than torch 2.11.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY = os.environ.get("DRY_RUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tokenmill.layers.attention import allocate_kv_cache  # noqa: E402
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from tokenmill.layers.backends.triton_paged import TritonPagedBackend  # noqa: E402
from tokenmill.layers.rotary import RopeConfig  # noqa: E402
from tokenmill.models.config import ModelConfig  # noqa: E402
from tokenmill.models.llama import LlamaForCausalLM  # noqa: E402
from tokenmill.models.loader import load_model  # noqa: E402
from tokenmill.quant.sparse24 import keep_mask_2_4  # noqa: E402
from tokenmill.runner.cuda_graphs import DecodeGraphs  # noqa: E402

BLOCK = 16


def greedy(model: LlamaForCausalLM, backend, prompt: list[int], steps: int, device: torch.device, graphs: bool):
    """Every step's logits ([P + steps - 1, V]: the prompt's, then each decode's) and `steps` greedy
    tokens, over a paged cache of `backend`'s layout;
    with `graphs`, the decode steps through DecodeGraphs (captured on CUDA; its buffers run eagerly on CPU)."""
    cfg = model.config
    blocks = -(-(len(prompt) + steps) // BLOCK)
    caches = allocate_kv_cache(
        backend, cfg.num_layers, blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.dtype, device
    )  # (the last block: the graphs' scratch)
    for layer in model.layers:
        layer.self_attn.backend = backend
    table = list(range(blocks))
    decode = (
        DecodeGraphs(model, caches, backend, BLOCK, blocks * BLOCK, blocks, [1, 2], capture=device.type == "cuda")
        if graphs
        else None
    )
    ids, tokens, rows = list(prompt), [], []
    with torch.no_grad():
        for step in range(steps):
            new = ids if step == 0 else ids[-1:]
            start = len(ids) - len(new)
            x, pos = torch.tensor(new, device=device), torch.arange(start, len(ids), device=device)
            if decode is not None and step > 0:
                decode.build_metadata([1], [len(ids)], [table], BLOCK, device)
                hidden = decode.forward(x, pos)
            else:
                md = backend.build_metadata([len(new)], [len(ids)], [table], BLOCK, device)
                hidden = model(x, pos, caches, md)
            logits = model.compute_logits(hidden)
            rows.append(logits.cpu())
            tokens.append(int(logits[-1].argmax()))
            ids.append(tokens[-1])
    return torch.cat(rows), tokens


def correctness(device: torch.device) -> dict:
    cpu = torch.device("cpu")
    prompt_len, steps = (11, 16) if not DRY else (4, 3)
    model = load_model(ROOT / "models" / "tokenmill-demo", dtype="float32", device=cpu)
    vocab = model.config.vocab_size
    prompt = [(7 + 131 * i) % vocab for i in range(prompt_len)]
    ref_logits, ref_tokens = greedy(model, TorchReferenceBackend(), prompt, steps, cpu, graphs=False)
    model = load_model(ROOT / "models" / "tokenmill-demo", dtype="float32", device=device)
    out: dict = {"cpu_reference_tokens": ref_tokens}
    ok = True
    for name, graphs in (("triton_eager", False), ("triton_cuda_graphs", True)):
        logits, tokens = greedy(model, TritonPagedBackend(), prompt, steps, device, graphs=graphs)
        diff = float((ref_logits - logits).abs().max())  # (the same tokens in: compared while they agree)
        out[name] = {"max_abs_logit_diff_vs_cpu": diff, "tokens_equal_cpu": tokens == ref_tokens}
        ok = ok and diff < 1e-3 and tokens == ref_tokens
    out["ok"] = ok
    return out


def shaped(dry: bool) -> ModelConfig:
    if dry:
        sizes = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "head_dim": 16}  # fmt: skip
    else:  # Llama-3-8B
        sizes = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
                 "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
    return ModelConfig(
        architecture="LlamaForCausalLM", max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope=RopeConfig(rope_type="default", theta=500000.0), tie_word_embeddings=False, qkv_bias=False,
        o_bias=False, mlp_bias=False, qk_norm=False, sliding_windows=(None,) * sizes["num_layers"],
        dtype="bfloat16", bos_token_id=1, eos_token_ids=(2,), **sizes,
    )  # fmt: skip


def interleaved(fns: dict, device: torch.device, repeats: int) -> dict:
    """name -> {median, min, max} ms of each function, timed in turn `repeats` times (interleaved)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed_ms(fn, device, 1))
    return {n: {"median": statistics.median(v), "min": min(v), "max": max(v)} for n, v in samples.items()}


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def roofline(device: torch.device) -> dict:
    cfg = shaped(DRY)
    dtype = torch.bfloat16 if not DRY else torch.float32
    backend = TritonPagedBackend()
    with device:
        model = LlamaForCausalLM(cfg, backend, dtype=dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.init_rotary(device)
    model.requires_grad_(False)
    weight_bytes = model.weight_bytes() - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    out: dict = {"weight_bytes_per_step": weight_bytes}
    if device.type == "cuda":
        big = torch.empty(4 * 1024**3, dtype=torch.uint8, device=device)
        copy_ms = timed_ms(lambda: big.clone(), device, 10)
        out["hbm_gbps"] = 2 * big.numel() / copy_ms / 1e6  # read + write
        del big
    context, repeats = (512, 20) if not DRY else (40, 1)
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if not DRY else 4)
    for batch in (1, 8, 64) if not DRY else (1, 2):
        blocks_each = -(-(context + 1) // BLOCK)
        scratch = batch * blocks_each  # the graphs' padding block
        caches = allocate_kv_cache(
            backend, cfg.num_layers, scratch + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        for c in caches:
            c.k.normal_(0, 1)
            c.v.normal_(0, 1)
        tables = [list(range(b * blocks_each, (b + 1) * blocks_each)) for b in range(batch)]
        seq_lens = [context + 1] * batch
        ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
        pos = torch.full((batch,), context, device=device)
        graphs = DecodeGraphs(
            model, caches, backend, BLOCK, blocks_each * BLOCK, scratch, [batch], capture=device.type == "cuda"
        )

        queries = [1] * batch

        def eager(ids=ids, pos=pos, caches=caches, tables=tables, seq_lens=seq_lens, queries=queries) -> None:
            with torch.no_grad():
                md = backend.build_metadata(queries, seq_lens, tables, BLOCK, device)
                model.compute_logits(model(ids, pos, caches, md)).argmax(-1).tolist()

        def graphed(ids=ids, pos=pos, graphs=graphs, tables=tables, seq_lens=seq_lens, queries=queries) -> None:
            with torch.no_grad():
                graphs.build_metadata(queries, seq_lens, tables, BLOCK, device)
                model.compute_logits(graphs.forward(ids, pos)).argmax(-1).tolist()

        eager()  # warm-up: the kernel compiles
        graphed()
        times = interleaved({"eager": eager, "cuda_graphs": graphed}, device, repeats)
        if device.type == "cuda":
            kv_bytes = batch * (context + 1) * kv_bytes_per_token
            floor_ms = (weight_bytes + kv_bytes) / (out["hbm_gbps"] * 1e6)
            out[f"decode_b{batch}"] = {
                "kv_bytes_per_step": kv_bytes,
                "floor_ms": floor_ms,
                **{name: {"step_ms": t, "fraction_of_roofline": floor_ms / t["median"]} for name, t in times.items()},
            }
        else:
            out[f"decode_b{batch}"] = "ran, eager and through the graphs' buffers (no timing under the interpreter)"
        del caches, graphs
    prompt = 2048 if not DRY else 24
    blocks = -(-prompt // BLOCK)
    caches = allocate_kv_cache(backend, cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    md = backend.build_metadata([prompt], [prompt], [list(range(blocks))], BLOCK, device)
    ids, pos = torch.randint(0, cfg.vocab_size, (prompt,), device=device), torch.arange(prompt, device=device)

    def prefill(sdpa: bool) -> None:  # the prompt's attention through SDPA (flash), or the paged kernel
        backend.sdpa_prompts = sdpa
        with torch.no_grad():
            model.compute_logits(model(ids, pos, caches, md)[-1:]).argmax(-1).tolist()

    prefill(True)
    prefill(False)
    times = interleaved({"sdpa": lambda: prefill(True), "kernel": lambda: prefill(False)}, device, 5 if not DRY else 1)
    backend.sdpa_prompts = True
    out["ttft_2048_ms"] = times if device.type == "cuda" else "ran, both ways (no timing under the interpreter)"
    return out


def sparse_linear(device: torch.device) -> dict:
    """The 8B shape's four projections pruned 2:4, semi-structured sparse against dense (bfloat16), at
    1 to 512 rows: the four together, each way, interleaved; on the CPU (dry run) only the pruning."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if DRY:
        shapes = {name: (n // 64, k // 64) for name, (n, k) in shapes.items()}
    dtype = torch.bfloat16
    dense = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        dense[name] = w * keep_mask_2_4(w.abs()).to(dtype)
    if device.type != "cuda":
        return {"ran": "pruned only: torch's semi-structured sparse kernels are CUDA-only"}
    from torch.sparse import to_sparse_semi_structured

    sparse = {name: to_sparse_semi_structured(w) for name, w in dense.items()}
    out: dict = {"shapes": {name: list(shape) for name, shape in shapes.items()}}
    for rows in (1, 16, 64, 128, 256, 512):
        xs = {name: torch.randn(rows, k, device=device, dtype=dtype) for name, (_, k) in shapes.items()}
        diff = max(
            float((F.linear(xs[nm], sparse[nm]).float() - F.linear(xs[nm], dense[nm]).float()).abs().max())
            for nm in shapes
        )

        def run(weights: dict, xs=xs) -> None:
            for name, w in weights.items():
                F.linear(xs[name], w)

        run(dense)
        run(sparse)
        times = interleaved({"dense": lambda: run(dense), "sparse_2_4": lambda: run(sparse)}, device, 20)
        out[f"rows_{rows}"] = {
            **times,
            "speedup": times["dense"]["median"] / times["sparse_2_4"]["median"],
            "max_abs_diff": diff,
        }
    return out


def main() -> None:
    """Each section's result is written as soon as it is in (a timeout keeps what came before it)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / (
        "gpu_check.json" if not DRY else "gpu_check_dry_run.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "dry_run": DRY,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
    }
    sections = (
        ("correctness", correctness),
        ("sparse_2_4_linear", sparse_linear),
        ("roofline_8b" if not DRY else "roofline_tiny", roofline),
    )
    for name, run in sections:
        result[name] = run(device)
        out.write_text(json.dumps(result, indent=1))
        print(name, json.dumps(result[name], indent=1), flush=True)
    if not result["correctness"]["ok"]:
        raise SystemExit("the Triton backend disagrees with the reference")


if __name__ == "__main__":
    main()
