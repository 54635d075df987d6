"""`tokenmill quantize`: a Hugging Face model folder -> a compressed-tensors checkpoint of it (the
format vLLM, transformers and llm-compressor read), written through the `compressed-tensors` library.

Owns the scheme and the writing: every projection of the decoder layers (q, k, v, o, gate, up,
down; the output projection and the embedding table stay as they are, `ignore: ["lm_head"]`) is
quantized symmetrically, int8 per output channel or per group (`Int8Weight`'s own rounding:
scale = max |w| / 127), or int4 in groups (default 32; scale = max |w| / 7, values in [-7, 7]: the
W4A16 scheme that transformers loads without zero points), packed with the library's
`pack_to_int32` into `weight_packed`, with `weight_scale` (float32) and `weight_shape`; the config
gains the library's `QuantizationConfig` (pack-quantized, compressed). tokenmill loads the folder as
stored (quant/compressed.py). Everything else in the folder (tokenizer, chat template,
generation config) is copied. Written beside its destination and renamed into place.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill.models.config import load_config
from tokenmill.models.loader import weight_files
from tokenmill.quant.quantize import MIN_GROUP
from tokenmill.tools.folder_write import write_folder

PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
METHODS = {"int8": 8, "int4": 4}


def symmetric_values(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scales [N, K / group] float32): symmetric, q = round(w / scale)."""
    n, k = w.shape
    top = 127 if bits == 8 else 7
    g = w.float().reshape(n, k // group, group)
    scales = g.abs().amax(-1) / top
    q = torch.round(g / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-top, top)
    return q.reshape(n, k).to(torch.int8), scales


def quantize_folder(
    src: str | Path, out: str | Path, method: str, group_size: int | None = None, overwrite: bool = False
) -> Path:
    """Write the compressed-tensors checkpoint `out` of the model folder `src`; returns `out`."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    src, out = Path(src), Path(out)
    if method not in METHODS:
        raise ValueError(f"quantization: expected one of {', '.join(METHODS)}, got {method!r}")
    cfg = load_config(src)
    if cfg.quantization is not None:
        raise ValueError(f"{src}: its layers are {cfg.quantization.method}-quantized already")
    if out.exists() and not overwrite:
        raise ValueError(f"out: {out} already exists (pass --overwrite to replace it)")
    bits = METHODS[method]
    group = group_size if group_size is not None else (32 if bits == 4 else None)
    if group is not None and (group < MIN_GROUP or group & (group - 1)):
        raise ValueError(f"group_size: expected a power of two from {MIN_GROUP}, got {group}")
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                w = f.get_tensor(name)
                if not PROJECTION.search(name):
                    tensors[name] = w
                    continue
                k = w.shape[1]
                if k % (group or k):
                    raise ValueError(f"group_size: {group} does not divide the input width {k} of {name}")
                q, scales = symmetric_values(w, bits, group or k)
                prefix = name.removesuffix(".weight")
                tensors[f"{prefix}.weight_packed"] = pack_to_int32(q, bits)
                tensors[f"{prefix}.weight_scale"] = scales.contiguous()
                tensors[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group)
    quant = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quant.model_dump(exclude_none=True)

    def write(staging: Path) -> None:
        for item in src.iterdir():  # tokenizer, chat template, generation config
            weights = item.name.endswith((".safetensors", ".index.json"))
            if item.is_file() and not weights and item.name != "config.json":
                shutil.copy2(item, staging / item.name)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(raw, indent=2) + "\n")

    return write_folder(out, write)
