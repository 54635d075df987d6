"""Model folder or GGUF file -> a ready `LlamaForCausalLM`: tensors streamed into fused parameters.

Owns finding the weight files (a single `model.safetensors`, or shards listed by
`model.safetensors.index.json`), checking every tensor's name against the model's checkpoint map,
and streaming each tensor, memory-mapped, to its parameter's `weight_loader` (layers/linear.py),
which checks its shape against the config before reading it and copies it once, straight into its
slice of the final (fused, converted) parameter. Then each linear layer's method gets its
`process_weights_after_loading` call. A GGUF file (`models/gguf_checkpoint.py`) gives its config
and its tensors, dequantized one at a time, through the same checks; the layers whose method takes
them as stored (`QuantConfig.gguf`) get them quantized (`kept_quantized`): Q8_0 / Q4_0 / Q4_1 in
tokenmill's int formats, the other block types (and a table kept in its blocks) as the file's bytes.
Pickle checkpoints (`*.bin`, `*.pt`) are refused, never loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend
from tokenmill.layers.linear import LinearBase, weight_loader_of
from tokenmill.layers.ops import LayerOps
from tokenmill.model_files import is_gguf
from tokenmill.models.config import ModelConfig, ModelLoadError, load_config
from tokenmill.models.gguf_checkpoint import DEQUANTIZED_TYPES, GGUFCheckpoint
from tokenmill.models.llama import LlamaForCausalLM, WeightTarget, layer_prefix
from tokenmill.quant.config import GGUF_EMBEDDING, GGUF_TABLE, QuantConfig
from tokenmill.quant.gguf_method import GGUFEmbedding, GGUFMatrix, held_matrices
from tokenmill.quant.int_methods import QuantizedLinearMethod
from tokenmill.quant.method import LinearMethod, WeightLoadError, WeightShapeError
from tokenmill.quant.quantize import Int4Weight, Int8Weight
from tokenmill.quant.sparse24 import SEMI_STRUCTURED_DTYPES, SPARSE_24_SUFFIXES, decompress_2_4, to_semi_structured

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
    tensor: torch.Tensor | Int8Weight | Int4Weight | GGUFMatrix,
    where: str,
) -> str | None:
    """Copy one checkpoint tensor (or a matrix kept quantized) into its parameter; returns the name
    loaded (None: skipped)."""
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
        return None
    target = targets.get(name)
    if target is None and f"model.{name}" in targets:  # a base model's name (saved without the LM's `model.`)
        name = f"model.{name}"
        target = targets[name]
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
    `sparse-24-bitmask` checkpoint's weights arrive as three tensors each (quant/sparse24.py), made
    dense here as the third comes in."""
    params = dict(model.named_parameters())
    targets = model.checkpoint_map()
    seen: set[str] = set()
    sparse = model.config.sparsity is not None and model.config.sparsity.format == "sparse-24-bitmask"
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a sparse weight's prefix -> its parts read so far

    def load(name: str, tensor: torch.Tensor, where: str) -> None:
        if name in seen:
            raise ModelLoadError(f"{where}: tensor '{name}' appears in more than one file")
        loaded = _load_tensor(model, params, targets, name, tensor, where)  # (a base model's: `model.` added)
        if loaded is not None:
            seen.add(loaded)

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


def gguf_layer_types(checkpoint: GGUFCheckpoint) -> dict[str, str]:
    """A GGUF file's linear layers (tokenmill's prefixes) -> the type of their matrices (a fused layer
    of several: their names joined by '+', sorted), the embedding table's (`GGUF_EMBEDDING`), and for a
    tied output projection its table's type again (`GGUF_TABLE`)."""
    types: dict[str, set[str]] = {}
    for info in checkpoint.infos:
        if info.hf_name.endswith(".weight") and len(info.shape) == 2:
            types.setdefault(layer_prefix(info.hf_name), set()).add(info.type_name)
    table = types.pop("embed_tokens", set())
    if table:
        types[GGUF_EMBEDDING] = table
    if checkpoint.config.tie_word_embeddings and table:
        types[GGUF_TABLE] = table
    return {prefix: "+".join(sorted(kinds)) for prefix, kinds in types.items()}


def kept_quantized(model: LlamaForCausalLM, checkpoint: GGUFCheckpoint, dtype: torch.dtype) -> dict[str, str]:
    """The checkpoint names of the matrices kept as stored -> how: "int" (a prequantized int method:
    Q8_0, Q4_0, Q4_1 in tokenmill's formats) or "blocks" (the file's own blocks: the K-quants, Q5_x,
    mixed fused layers, a table kept in its blocks); the log says which types stay quantized and which
    are dequantized at load."""
    types = {i.hf_name: i.type_name for i in checkpoint.infos}
    layers = dict(model.named_modules())
    keep: dict[str, str] = {}
    for name, target in model.checkpoint_map().items():
        module, _, suffix = target.param.rpartition(".")
        layer = layers.get(module)
        if suffix != "weight" or name not in types:
            continue
        if isinstance(layer, GGUFEmbedding):
            keep[name] = "blocks"
        elif isinstance(layer, LinearBase) and getattr(layer.linear_method, "prequantized", False):
            keep[name] = "blocks" if getattr(layer.linear_method, "keeps_blocks", False) else "int"
    dequantized = Counter(i.type_name for i in checkpoint.infos if len(i.shape) == 2 and i.hf_name not in keep)
    if unkept := sorted(t for t in dequantized if t in DEQUANTIZED_TYPES):
        logger.warning(
            "GGUF %s: no kernel here reads these types as stored; their matrices are dequantized to %s at "
            "load, held and read at its size, not the file's (a Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 file "
            "stays quantized)",
            ", ".join(unkept),
            str(dtype).removeprefix("torch."),
        )
    logger.info(
        "GGUF matrices kept quantized: %s; dequantized at load to %s: %s",
        ", ".join(f"{n} {t}" for t, n in sorted(Counter(types[n] for n in keep).items())) or "none",
        str(dtype).removeprefix("torch."),
        ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())) or "none",
    )
    return keep


def load_gguf_weights(model: LlamaForCausalLM, checkpoint: GGUFCheckpoint, keep: dict[str, str] | None = None) -> None:
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
    layers = {n: m for n, m in model.layers.named_modules(prefix="layers") if isinstance(m, LinearBase)}
    done, refused = to_semi_structured(layers)
    logger.info("2:4 sparse weights: %d of %d decoder projections on the sparse tensor cores", len(done), len(layers))
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
    quant: QuantConfig | None = None,
    place: Callable[[LlamaForCausalLM], object] | None = None,
    workers: int = 1,
) -> LlamaForCausalLM:
    """Load a Llama-family model folder or GGUF file (a path, or an opened `GGUFCheckpoint`) for
    inference (eval mode, no gradients). `quant` names each layer's linear method (None: what the
    checkpoint stores, else dense; `linear_method` / `head_method` are shorthand for one method for
    every projection and the output projection's own); `ops` runs the norms, activations and rotary
    embeddings (None: the torch reference); `place`, where given, re-homes the model's allocated but
    unfilled tensors before the weights are copied in (runner/huge_pages.py `place_on_huge_pages`);
    `workers`: threads the layers are quantized on (`process_layers`; each runs torch's ops on the
    threads torch is set to, so a caller spreading them sets torch to one: runner/model_builder.py)."""
    if isinstance(folder, GGUFCheckpoint):
        checkpoint: GGUFCheckpoint | None = folder
        folder = folder.path
    else:
        folder = Path(folder)
        checkpoint = GGUFCheckpoint(folder) if is_gguf(folder) else None
    cfg = checkpoint.config if checkpoint else load_config(folder)
    if quant is None:
        if linear_method is None and cfg.quantization is not None:  # an AWQ / GPTQ folder: its layers as stored
            stored = QuantConfig.for_checkpoint(cfg.quantization)
            quant = QuantConfig(stored.layers, head_method or stored.head, name=stored.name)
        else:
            quant = QuantConfig.uniform(linear_method, head_method)
    if checkpoint and quant.gguf and not quant.gguf_types:
        quant = dataclasses.replace(quant, gguf_types=gguf_layer_types(checkpoint))
    torch_dtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    attention: AttentionBackend = backend or TorchReferenceBackend()
    with device:  # parameters are allocated uninitialized, in their final dtype, on their device
        model = LlamaForCausalLM(cfg, attention, quant=quant, dtype=torch_dtype, ops=ops)
    if place is not None:
        place(model)
    if checkpoint:
        keep = kept_quantized(model, checkpoint, torch_dtype) if quant.gguf else {}
        load_gguf_weights(model, checkpoint, keep)
    else:
        load_weights(model, folder)
    _finish(model, cfg, device, workers)
    if checkpoint:
        log_block_forms(model)
        release_freed_memory()
    return model.eval()


def log_block_forms(model: LlamaForCausalLM) -> None:
    """Log the forms the GGUF matrices kept in their blocks took at load: repacked into 16-row groups
    (`--gguf-repack`) or as the file stores them; a fused layer's run of one type counts once."""
    matrices = held_matrices(model.modules())
    if not matrices:
        return
    forms = {True: Counter[str](), False: Counter[str]()}
    for m in matrices:
        forms[m.repacked][m.type_name] += 1

    def listed(counts: Counter[str]) -> str:
        return ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) or "none"

    repacked, stored = listed(forms[True]), listed(forms[False])
    logger.info("GGUF blocks in 16-row groups: %s; as the file stores them: %s", repacked, stored)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`): a GGUF load's tensors are
    read and reordered through buffers of many sizes, and the holes they leave would otherwise stay
    resident (about 8% of a 1.1B Q4_K_M file's size). Elsewhere a no-op."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # (not glibc)
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _finish(model: LlamaForCausalLM, cfg: ModelConfig, device: torch.device, workers: int = 1) -> None:
    """After every tensor is in: each layer repacked or quantized (`process_layers`), a tied head
    settled, 2:4 weights moved to the sparse tensor cores, the rotary tables built."""
    model.fill_tied_head()
    process_layers(model, workers)
    model.finish_loading()
    if cfg.sparsity is not None:
        _run_2_4(model, device)
    model.init_rotary(device)
    model.requires_grad_(False)


def process_layers(model: LlamaForCausalLM, workers: int = 1) -> None:
    """Each linear layer's `process_weights_after_loading`, in module order; with `workers` > 1 the
    layers a method quantizes (each on its own: no state shared) spread over that many threads, each
    quantizing one layer at a time (torch's ops let go of the GIL). An error names the first layer
    that failed, in module order, as one thread would."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]

    def process(item: tuple[str, LinearBase]) -> None:
        name, module = item
        try:
            module.process_weights_after_loading()
        except ValueError as e:  # e.g. a quantization group size that does not divide this layer
            raise ValueError(f"{name}: {e}") from None

    def quantizes(module: LinearBase) -> bool:
        method = module.linear_method
        return isinstance(method, QuantizedLinearMethod) and not method.prequantized

    spread = [item for item in layers if workers > 1 and quantizes(item[1])]
    if spread:
        with ThreadPoolExecutor(workers, thread_name_prefix="quantize") as pool:
            list(pool.map(process, spread))  # (the results in order: the first error in module order)
    done = {id(module) for _, module in spread}
    for item in layers:
        if id(item[1]) not in done:
            process(item)
