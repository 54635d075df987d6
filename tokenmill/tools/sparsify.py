"""`tokenmill sparsify`: 2:4 pruning of a model folder's decoder projections, written as compressed-tensors.

In every group of 4 consecutive inputs of each output row of every decoder projection (q, k, v, o,
gate, up, down; the embedding table and the output projection stay whole), the 2 weights with the
lowest score are set to zero: the pattern NVIDIA's sparse tensor cores (and torch's semi-structured
sparse kernels, cuSPARSELt) run at up to twice the dense rate. Scores:
- `magnitude`: |w|;
- `wanda` (Sun et al., 2023): |w| x the L2 norm of its input feature over calibration text (the
  standard library's held-out files, as `eval-quant` reads them), so that a small weight on a loud
  input is kept; the norms are collected from the dense model's own forward, layer by layer.

The folder is written as llm-compressor writes its 2:4 models: config.json's `quantization_config`
names compressed-tensors with a `sparsity_config` (2:4, targets Linear, ignore lm_head), the pruned
weights stored `sparse-24-bitmask` (half the values and a bitmask: quant/sparse24.py), or `dense`
(zeros in place). It loads here (and in vLLM); on a GPU in float16 / bfloat16 the projections then run
on the sparse tensor cores, on a CPU dense (torch's semi-structured kernels are CUDA-only), and the
log says which. The quality cost is `eval-quant`'s measures, against the dense model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill.models.loader import weight_files
from tokenmill.quant.sparse24 import compress_2_4, keep_mask_2_4
from tokenmill.tools.folder_write import write_folder

PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
METHODS = ("magnitude", "wanda")
FORMATS = ("sparse-24-bitmask", "dense")


def prune_2_4(weight: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K a multiple of 4) with, in each group of 4 inputs of a row, the 2 lowest-scored zeroed."""
    return weight * keep_mask_2_4(score).to(weight.dtype)


def input_norms(model_dir: Path, windows: int, length: int) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, projection kind) -> [K] L2 norm of each input feature over calibration text (wanda's)."""
    from tokenmill.eval.quant_eval import text_windows
    from tokenmill.layers.attention import allocate_kv_cache
    from tokenmill.layers.backends.torch_ref import TorchReferenceBackend
    from tokenmill.models.loader import load_model
    from tokenmill.text.tokenizer import Tokenizer

    model = load_model(model_dir, dtype="float32")
    sums: dict[tuple[int, str], torch.Tensor] = {}

    def hook(key: tuple[int, str]):  # type: ignore[no-untyped-def]
        def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = args[0].float().reshape(-1, args[0].shape[-1])
            sums[key] = sums.get(key, torch.zeros(x.shape[1])) + (x * x).sum(0)

        return record

    handles = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for kind, module in (
            ("qkv", attn.qkv_proj),
            ("o", attn.o_proj),
            ("gate_up", mlp.gate_up_proj),
            ("down", mlp.down_proj),
        ):
            handles.append(module.register_forward_hook(hook((i, kind))))
    wins, _ = text_windows(Tokenizer(str(model_dir)), None, windows, length)
    backend = TorchReferenceBackend()
    cfg = model.config
    with torch.inference_mode():
        for window in wins:
            blocks = -(-length // 16)
            caches = allocate_kv_cache(backend, cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, model.dtype)
            md = backend.build_metadata([length], [length], [list(range(blocks))], 16)
            model(window, torch.arange(length), caches, md)
    for h in handles:
        h.remove()
    return {key: total.sqrt() for key, total in sums.items()}


KIND = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}


def sparsify_folder(
    src: str | Path,
    out: str | Path,
    method: str,
    overwrite: bool = False,
    windows: int = 8,
    length: int = 256,
    storage: str = "sparse-24-bitmask",
) -> Path:
    """Write the 2:4-pruned copy `out` of the model folder `src` (its projections stored `storage`: one
    of FORMATS); returns `out`."""
    src, out = Path(src), Path(out)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if storage not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {storage!r}")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config"):
        raise ValueError(f"model: {src} is quantized already ({config['quantization_config'].get('quant_method')})")
    if out.exists() and not overwrite:
        raise ValueError(f"out: {out} already exists (pass --overwrite to replace it)")
    norms = input_norms(src, windows, length) if method == "wanda" else {}
    tensors: dict[str, torch.Tensor] = {}
    zeros = total = 0
    for path in weight_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open's handle is not a mapping)
                w = f.get_tensor(name)
                found = PROJECTION.match(name)
                if found is None:
                    tensors[name] = w
                    continue
                score = w.abs().float()
                if method == "wanda":
                    score = score * norms[(int(found.group(1)), KIND[found.group(3)])][None, :]
                pruned = prune_2_4(w, score).contiguous()
                zeros, total = zeros + int((pruned == 0).sum()), total + pruned.numel()
                if storage == "dense":
                    tensors[name] = pruned
                else:
                    prefix = name.removesuffix(".weight")
                    tensors |= {prefix + suffix: t for suffix, t in compress_2_4(pruned).items()}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "sparsity_config": {
            "format": storage,
            "sparsity_structure": "2:4",
            "targets": ["Linear"],
            "ignore": ["lm_head"],
            "global_sparsity": zeros / max(total, 1),
        },
    }

    def write(staging: Path) -> None:
        for item in src.iterdir():
            if (
                item.is_file()
                and not item.name.endswith((".safetensors", ".index.json"))
                and item.name != "config.json"
            ):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

    return write_folder(out, write)
