"""Model folder or GGUF file -> a ready `LlamaForCausalLM`: tensors streamed into fused parameters.

Owns finding the weight files (a single `model.safetensors`, or shards listed by
`model.safetensors.index.json`), checking every tensor's name against the model's checkpoint map,
and streaming each tensor, memory-mapped, to its parameter's `weight_loader` (layers/linear.py),
which checks its shape against the config before reading it and copies it once, straight into its
slice of the final (fused, converted) parameter. Then each linear layer's method gets its
`process_weights_after_loading` call. A GGUF file (`models/gguf_checkpoint.py`) gives its config
and its tensors, dequantized one at a time, through the same checks; with `checkpoint_methods`, its
Q8_0 / Q4_0 / Q4_1 matrices stay quantized as stored (`keep_quantized`). Pickle checkpoints (`*.bin`,
`*.pt`) are refused, never loaded.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend
from tokenmill.layers.linear import (
    LinearBase,
    LinearMethod,
    UnquantizedLinearMethod,
    WeightLoadError,
    WeightShapeError,
    weight_loader_of,
)
from tokenmill.layers.ops import LayerOps
from tokenmill.layers.quantize import Int4Weight, Int8Weight
from tokenmill.layers.sparse24 import SEMI_STRUCTURED_DTYPES, SPARSE_24_SUFFIXES, decompress_2_4, to_semi_structured
from tokenmill.models.config import ModelConfig, ModelLoadError, load_config
from tokenmill.models.gguf_checkpoint import GGUFCheckpoint, is_gguf
from tokenmill.models.llama import LlamaForCausalLM, WeightTarget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the forward recomputes rather than loads.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

logger = logging.getLogger("tokenmill")


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 when config.json names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        return DTYPES.get(cfg.dtype or "float32", torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """Safetensors files of the folder -> the tensor names the index assigns them (None: all)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index}: malformed index, field 'weight_map' ({e})") from None
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(folder / str(file), []).append(name)  # type: ignore[union-attr]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{path}: listed in {INDEX_FILE} but missing from the folder")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return {single: None}
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return {p: None for p in shards}
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ModelLoadError(
            f"{folder}: only pickle checkpoints ({', '.join(pickles)}) found; tokenmill loads "
            "safetensors only and never unpickles model files (convert with safetensors first)"
        )
    raise ModelLoadError(f"{folder}: no model.safetensors (or *.safetensors shards) in the model folder")


def _load_tensor(
    model: LlamaForCausalLM,
    params: dict[str, torch.nn.Parameter],
    targets: dict[str, WeightTarget],
    name: str,
    tensor: torch.Tensor | Int8Weight | Int4Weight,
    where: str,
) -> str | None:
    """Copy one checkpoint tensor (or a matrix kept quantized) into its parameter; returns the name
    loaded (None: skipped)."""
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
        return None
    target = targets.get(name)
    if target is None:
        raise ModelLoadError(
            f"{where}: unexpected tensor '{name}' (not part of a {model.config.architecture} with this config)"
        )
    param = params[target.param]
    try:  # a view of the mapped file: nothing is read before the shape check
        weight_loader_of(param)(param, cast(torch.Tensor, tensor), target.shard_id)
    except WeightShapeError as e:
        raise ModelLoadError(
            f"{where}: tensor '{name}' has shape {list(e.got)}, the config implies {list(e.expected)}"
        ) from None
    except WeightLoadError as e:
        raise ModelLoadError(f"{where}: tensor '{name}': {e}") from None
    return name


def _check_complete(model: LlamaForCausalLM, seen: set[str], where: str) -> None:
    missing = sorted(set(model.checkpoint_map()) - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"{where}: tensor '{missing[0]}'{more} missing from the checkpoint")


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Fill every parameter of `model` from the folder's safetensors, checking names and shapes. A
    `sparse-24-bitmask` checkpoint's weights arrive as three tensors each (layers/sparse24.py), made
    dense here as the third comes in."""
    params = dict(model.named_parameters())
    targets = model.checkpoint_map()
    seen: set[str] = set()
    sparse = model.config.sparsity is not None and model.config.sparsity.format == "sparse-24-bitmask"
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a sparse weight's prefix -> its parts read so far

    def load(name: str, tensor: torch.Tensor, where: str) -> None:
        if name in seen:
            raise ModelLoadError(f"{where}: tensor '{name}' appears in more than one file")
        if _load_tensor(model, params, targets, name, tensor, where):
            seen.add(name)

    for path, indexed_names in weight_files(folder).items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f, torch.no_grad():
                names = list(f.keys())
                if indexed_names is not None:
                    absent = sorted(set(indexed_names) - set(names))
                    if absent:
                        raise ModelLoadError(f"{path}: tensor '{absent[0]}' listed in {INDEX_FILE} is not in this file")
                for name in names:
                    if not (sparse and name.endswith(SPARSE_24_SUFFIXES)):
                        load(name, f.get_tensor(name), str(path))
                        continue
                    prefix, suffix = name.rsplit(".", 1)
                    got = parts.setdefault(prefix, {})
                    got["." + suffix] = f.get_tensor(name)
                    if len(got) == len(SPARSE_24_SUFFIXES):
                        try:
                            dense = decompress_2_4(got[".shape"], got[".compressed"], got[".bitmask"], prefix)
                        except ValueError as e:
                            raise ModelLoadError(f"{path}: tensor {e}") from None
                        load(f"{prefix}.weight", dense, str(path))
                        del parts[prefix]
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
    for prefix, got in parts.items():
        absent = next(s for s in SPARSE_24_SUFFIXES if s not in got)
        raise ModelLoadError(f"{folder}: tensor '{prefix}{absent}' missing from the checkpoint (sparse-24-bitmask)")
    _check_complete(model, seen, f"{folder}")


def keep_quantized(
    model: LlamaForCausalLM, checkpoint: GGUFCheckpoint, methods: Mapping[str, LinearMethod], dtype: torch.dtype
) -> frozenset[str]:
    """Switch every linear layer whose GGUF matrices share one type that `methods` maps (Q8_0, Q4_0,
    Q4_1) to that method, which takes them as stored; the checkpoint names read that way. The other
    matrices (the K-quants, a fused layer of mixed types, the embedding table) are dequantized at load,
    and the log says which."""
    types = {i.hf_name: i.type_name for i in checkpoint.infos}
    layers = dict(model.named_modules())
    by_layer: dict[str, list[str]] = {}
    for name, target in model.checkpoint_map().items():
        module, _, suffix = target.param.rpartition(".")
        if suffix == "weight" and isinstance(layers.get(module), LinearBase) and name in types:
            by_layer.setdefault(module, []).append(name)
    keep: set[str] = set()
    for module, names in by_layer.items():
        kinds = {types[n] for n in names}
        method = methods.get(next(iter(kinds))) if len(kinds) == 1 else None
        if method is not None:
            cast(LinearBase, layers[module]).use_method(method, dtype)
            keep.update(names)
    dequantized = Counter(i.type_name for i in checkpoint.infos if len(i.shape) == 2 and i.hf_name not in keep)
    logger.info(
        "GGUF matrices kept quantized: %s; dequantized at load to %s: %s",
        ", ".join(f"{n} {t}" for t, n in sorted(Counter(types[n] for n in keep).items())) or "none",
        str(dtype).removeprefix("torch."),
        ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())) or "none",
    )
    return frozenset(keep)


def load_gguf_weights(model: LlamaForCausalLM, checkpoint: GGUFCheckpoint, keep: frozenset[str] = frozenset()) -> None:
    """Fill every parameter of `model` from a GGUF file, each tensor dequantized as it is read (those in
    `keep` handed over quantized)."""
    params = dict(model.named_parameters())
    targets = model.checkpoint_map()
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in checkpoint.tensors(keep):
            if _load_tensor(model, params, targets, name, tensor, str(checkpoint.path)):
                seen.add(name)
    _check_complete(model, seen, str(checkpoint.path))


def read_model_config(model: str | Path | GGUFCheckpoint) -> ModelConfig:
    """The `ModelConfig` of a model folder (its config.json) or of a GGUF file (its metadata)."""
    if isinstance(model, GGUFCheckpoint):
        return model.config
    if is_gguf(model):
        return GGUFCheckpoint(model).config
    return load_config(Path(model))


def _run_2_4(model: LlamaForCausalLM, device: torch.device) -> None:
    """A 2:4 checkpoint's decoder projections on the sparse tensor cores where they run (CUDA, float16
    or bfloat16); elsewhere dense, and the log says so."""
    if device.type != "cuda" or model.dtype not in SEMI_STRUCTURED_DTYPES:
        logger.info(
            "2:4 sparse weights run dense on %s in %s: no 2:4 kernel runs them faster here (torch's "
            "semi-structured sparse kernels need CUDA and float16 or bfloat16)",
            device.type,
            model.dtype,
        )
        return
    names = {n for n, m in model.layers.named_modules(prefix="layers") if isinstance(m, LinearBase)}
    done, refused = to_semi_structured(model, names)
    logger.info("2:4 sparse weights: %d of %d decoder projections on the sparse tensor cores", len(done), len(names))
    if refused:
        name, why = next(iter(refused.items()))
        logger.info("2:4 sparse weights: %d layers stay dense (%s: %s)", len(refused), name, why)


def load_model(
    folder: str | Path | GGUFCheckpoint,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    linear_method: LinearMethod | None = None,
    ops: LayerOps | None = None,
    head_method: LinearMethod | None = None,
    checkpoint_methods: Mapping[str, LinearMethod] | None = None,
) -> LlamaForCausalLM:
    """Load a Llama-family model folder or GGUF file (a path, or an opened `GGUFCheckpoint`) for
    inference (eval mode, no gradients). `linear_method`
    holds and applies the projections' weights (None: unquantized, in `dtype`); `ops` runs the
    norms, activations and rotary embeddings (None: the torch reference); `checkpoint_methods`: a GGUF
    tensor type -> the method that keeps such matrices quantized as stored (`keep_quantized`)."""
    if isinstance(folder, GGUFCheckpoint):
        checkpoint: GGUFCheckpoint | None = folder
        folder = folder.path
    else:
        folder = Path(folder)
        checkpoint = GGUFCheckpoint(folder) if is_gguf(folder) else None
    cfg = checkpoint.config if checkpoint else load_config(folder)
    if cfg.quantization is not None and linear_method is None:  # an AWQ / GPTQ folder: its layers as stored
        from tokenmill.layers.awq_gptq import checkpoint_method

        linear_method, head_method = checkpoint_method(cfg.quantization, None), head_method or UnquantizedLinearMethod()
    torch_dtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    attention: AttentionBackend = backend or TorchReferenceBackend()
    with device:  # parameters are allocated uninitialized, in their final dtype, on their device
        model = LlamaForCausalLM(
            cfg, attention, linear_method=linear_method, head_method=head_method, dtype=torch_dtype, ops=ops
        )
    if checkpoint:
        keep = keep_quantized(model, checkpoint, checkpoint_methods, torch_dtype) if checkpoint_methods else frozenset()
        load_gguf_weights(model, checkpoint, keep)
    else:
        load_weights(model, folder)
    model.fill_tied_head()
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            try:
                module.process_weights_after_loading()
            except ValueError as e:  # e.g. a quantization group size that does not divide this layer
                raise ValueError(f"{name}: {e}") from None
    model.finish_loading()
    if cfg.sparsity is not None:
        _run_2_4(model, device)
    model.init_rotary(device)
    model.requires_grad_(False)
    return model.eval()
