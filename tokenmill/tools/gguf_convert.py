"""`tokenmill convert`: a GGUF file -> a Hugging Face model folder that transformers and tokenmill load.

Owns writing the folder: `model.safetensors` (every tensor dequantized, in the Hugging Face layout,
in the chosen dtype; a tied LM head is not written twice), `config.json` (the metadata's config, with
`model_type` and `dtype`), the tokenizer as the GGUF describes it (`tokenizer.json`,
`tokenizer_config.json` with the chat template; text/gguf_tokenizer.py) and
`generation_config.json` (BOS and the ids that end generation). The folder is written beside its
destination and renamed into place, so an interrupted conversion leaves no half-written model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file

from tokenmill.models.gguf_checkpoint import GGUFCheckpoint
from tokenmill.models.loader import resolve_dtype
from tokenmill.text.gguf_tokenizer import load_gguf_tokenizer
from tokenmill.tools.folder_write import write_folder

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# How the tokenizer was loaded, which transformers writes into tokenizer_config.json: not the model's.
LOAD_TIME_KEYS = ("is_local", "local_files_only")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def convert_gguf(path: str | Path, out: str | Path, dtype: str = "auto", overwrite: bool = False) -> Path:
    """Write the Hugging Face folder `out` from the GGUF file `path`; returns `out`."""
    checkpoint = GGUFCheckpoint(path)
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"out: {out} already exists (pass --overwrite to replace it)")
    torch_dtype = resolve_dtype(dtype, checkpoint.config)
    return write_folder(out, lambda staging: _write(checkpoint, staging, torch_dtype))


def _write(checkpoint: GGUFCheckpoint, folder: Path, dtype: torch.dtype) -> None:
    cfg = checkpoint.config
    tensors = {
        name: cast(torch.Tensor, tensor).to(dtype).contiguous()  # (nothing kept quantized: all tensors)
        for name, tensor in checkpoint.tensors()
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings)
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(checkpoint.raw_config)
    config["model_type"] = MODEL_TYPES[cfg.architecture]
    config["dtype"] = DTYPE_NAMES[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tokenizer, ends = load_gguf_tokenizer(checkpoint.path, checkpoint.metadata)
    tokenizer.model_max_length = cfg.max_position_embeddings
    tokenizer.save_pretrained(str(folder))
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text(encoding="utf-8"))
    for key in LOAD_TIME_KEYS:
        settings.pop(key, None)
    settings_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    generation: dict[str, object] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(ends)}
    if tokenizer.pad_token_id is not None:
        generation["pad_token_id"] = tokenizer.pad_token_id
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    folder.chmod(0o755)  # mkdtemp made it private
    for file in folder.iterdir():
        file.chmod(0o644)
