"""The GPU check, one prepared run for a lent device (benchmarks/gpu/check.sh runs it, JSON to $OUT).

1. Correctness: the bundled demo model (models/tokenmill-demo, float32) decodes 16 greedy tokens with
   the Triton attention backend and with the torch reference, on the device: the prompt's logits
   within 1e-3 of each other, the same tokens.
2. Against the hardware's limit (GPU only): a Llama-3-8B-shaped model with random bfloat16 weights,
   built on the device (no download), decoding at batch 1, 8 and 64 with 512 tokens of context each
   (the cache filled at random: the step reads it all the same): the step's time against its weight
   bytes over the HBM bandwidth measured in the same run (a 4 GiB device-to-device copy), and a
   2,048-token prompt's prefill (TTFT). Eager steps: CUDA graphs and the 2:4 layers are not in yet.

DRY_RUN=1: everything on the CPU under Triton's interpreter, with tiny shapes and no timing, so that
the script is known to run before a device is lent. Imports no server module (the device has torch,
triton and transformers only); uses nothing newer than torch 2.11.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tokenmill.layers.attention import allocate_kv_cache  # noqa: E402
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from tokenmill.layers.backends.triton_paged import TritonPagedBackend  # noqa: E402
from tokenmill.layers.rotary import RopeConfig  # noqa: E402
from tokenmill.models.config import ModelConfig  # noqa: E402
from tokenmill.models.llama import LlamaForCausalLM  # noqa: E402
from tokenmill.models.loader import load_model  # noqa: E402

BLOCK = 16


def greedy(model: LlamaForCausalLM, backend, prompt: list[int], steps: int, device: torch.device):
    """The prompt's logits [P, V] and `steps` greedy tokens, over a paged cache of `backend`'s layout."""
    cfg = model.config
    blocks = -(-(len(prompt) + steps) // BLOCK)
    caches = allocate_kv_cache(
        backend, cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.dtype, device
    )
    for layer in model.layers:
        layer.self_attn.backend = backend
    table = list(range(blocks))
    ids, tokens, first = list(prompt), [], None
    with torch.no_grad():
        for step in range(steps):
            new = ids if step == 0 else ids[-1:]
            start = len(ids) - len(new)
            md = backend.build_metadata([len(new)], [len(ids)], [table], BLOCK, device)
            x = torch.tensor(new, device=device)
            logits = model.compute_logits(model(x, torch.arange(start, len(ids), device=device), caches, md))
            first = logits if first is None else first
            tokens.append(int(logits[-1].argmax()))
            ids.append(tokens[-1])
    return first, tokens


def correctness(device: torch.device) -> dict:
    model = load_model(ROOT / "models" / "tokenmill-demo", dtype="float32", device=device)
    vocab = model.config.vocab_size
    prompt = [(7 + 131 * i) % vocab for i in range(11 if not DRY else 4)]
    steps = 16 if not DRY else 3
    ref_logits, ref_tokens = greedy(model, TorchReferenceBackend(), prompt, steps, device)
    tri_logits, tri_tokens = greedy(model, TritonPagedBackend(), prompt, steps, device)
    diff = float((ref_logits - tri_logits).abs().max())
    return {
        "max_abs_logit_diff": diff,
        "tokens_equal": ref_tokens == tri_tokens,
        "ok": diff < 1e-3 and ref_tokens == tri_tokens,
    }


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
    for batch in (1, 8, 64) if not DRY else (1, 2):
        blocks_each = -(-(context + 1) // BLOCK)
        caches = allocate_kv_cache(
            backend, cfg.num_layers, batch * blocks_each, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        for c in caches:
            c.k.normal_(0, 1)
            c.v.normal_(0, 1)
        tables = [list(range(b * blocks_each, (b + 1) * blocks_each)) for b in range(batch)]
        md = backend.build_metadata([1] * batch, [context + 1] * batch, tables, BLOCK, device)
        ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
        pos = torch.full((batch,), context, device=device)

        def step(ids=ids, pos=pos, caches=caches, md=md) -> None:
            with torch.no_grad():
                model.compute_logits(model(ids, pos, caches, md))

        step()  # warm-up: the kernel compiles
        ms = timed_ms(step, device, repeats)
        if device.type == "cuda":
            floor_ms = weight_bytes / (out["hbm_gbps"] * 1e6)
            out[f"decode_b{batch}"] = {"step_ms": ms, "floor_ms": floor_ms, "fraction_of_roofline": floor_ms / ms}
        else:
            out[f"decode_b{batch}"] = "ran (no timing under the interpreter)"
        del caches
    prompt = 2048 if not DRY else 24
    blocks = -(-prompt // BLOCK)
    caches = allocate_kv_cache(backend, cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    md = backend.build_metadata([prompt], [prompt], [list(range(blocks))], BLOCK, device)
    ids, pos = torch.randint(0, cfg.vocab_size, (prompt,), device=device), torch.arange(prompt, device=device)

    def prefill() -> None:
        with torch.no_grad():
            model.compute_logits(model(ids, pos, caches, md)[-1:])

    prefill()
    ttft = timed_ms(prefill, device, 5 if not DRY else 1)
    out["ttft_2048_ms"] = ttft if device.type == "cuda" else "ran (no timing under the interpreter)"
    return out


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
    result = {
        "dry_run": DRY,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "correctness": correctness(device),
        "roofline_8b" if not DRY else "roofline_tiny": roofline(device),
        "not_measured_yet": ["CUDA graphs", "2:4 sparse layers"],
    }
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / (
        "gpu_check.json" if not DRY else "gpu_check_dry_run.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if not result["correctness"]["ok"]:
        raise SystemExit("the Triton backend disagrees with the reference")


if __name__ == "__main__":
    main()
