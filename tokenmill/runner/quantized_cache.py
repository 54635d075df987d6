"""Quantized weights cached on disk: a float checkpoint quantized at load (`--quantization int8`,
`int4`, `w8a8`) is quantized once, written, and read back on every later start instead.

The cache of one build is the folder `$TOKENMILL_CACHE_DIR/quantized/<key>/` (default
`~/.cache/tokenmill/quantized/`; `$TOKENMILL_QUANTIZED_CACHE_DIR` moves it elsewhere), the key a hash
of everything the quantized values depend on: the checkpoint's folder and files (names, sizes,
modification times: a rewritten file is a new key), the dtype the weights were loaded in before
quantizing, each quantized method (its class, its `QuantSpec`: method, group size, fallback, head;
and whether tokenmill's native kernels are there, which picks the int4 layout; for GGUF blocks, the
source of their 16-row layout), the quantization code's own source, and this file's `FORMAT`. It
holds one safetensors file (never pickle): every parameter the model keeps (embedding table, norms,
biases, a dense head) under its own name, and each quantized layer's tensors as `<layer>::<field>`
(`Int8Weight.q`, `.scales`, `.wsums`; `Int4Weight.packed`, ...; `GGUFMatrix.data` for int8 / int4
kept in GGUF blocks), the layers' formats and plain fields (group, rows) in the file's metadata beside
the key's text. It is written beside its place and renamed in (a second process starting at once writes
its own and one rename wins), streamed tensor by tensor (no second copy of the weights in memory).

A cached build makes the model's modules as a load does (the quantized layers' dense weights are
allocated and never touched), hands each quantized layer its weights, then every parameter its
tensor, and finishes as the loader does (the tied table dropped for a quantized head, the rotary
tables built). The tensors read are views of the file's mapping, and one of them alive keeps the whole
mapping, every page the build read, resident: so those under a huge page (norms, biases, scales) are
copied out, and the large ones are copied onto huge pages after the build (runner/huge_pages.py), or,
where there are none, stay in the mapping as the weights themselves. A cache that does not read back
whole (truncated, another key's, a layer or shape missing) is a warning, and the checkpoint is
quantized again and the cache rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.ops import LayerOps
from tokenmill.model_files import cache_dir, is_gguf
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import read_model_config, weight_files
from tokenmill.quant import quantize
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.gguf_method import GGUFMatrix
from tokenmill.quant.int_methods import QuantizedLinearMethod
from tokenmill.quant.quantize import Int4PackWeight, Int4Weight, Int8Weight
from tokenmill.runner.huge_pages import HUGE_PAGE

logger = logging.getLogger("tokenmill")

FORMAT = 1  # this file's layout; a change makes every key new
FILE = "model.safetensors"
META = "tokenmill"  # the safetensors metadata entry holding the key and the layers' formats
SEP = "::"  # <layer>::<field> names a quantized layer's tensor
FORMATS: dict[str, type] = {cls.__name__: cls for cls in (Int8Weight, Int4Weight, Int4PackWeight, GGUFMatrix)}
DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}  # fmt: skip


class CacheMismatch(Exception):
    """The cached file does not fit the model being built (the message says how)."""


@dataclasses.dataclass(frozen=True)
class QuantizedCache:
    """One build's cache: its folder and the text its key hashes."""

    folder: Path
    key_text: str

    @property
    def file(self) -> Path:
        return self.folder / FILE

    def exists(self) -> bool:
        return self.file.is_file()

    def save(self, model: LlamaForCausalLM) -> None:
        """Write `model`'s parameters and quantized layers (after a load that quantized them)."""
        layers: dict[str, dict[str, object]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, layer in model.quantized_layers():
            weight = layer.quantized  # type: ignore[attr-defined]
            info: dict[str, object] = {"format": type(weight).__name__, "tensors": []}
            for field in dataclasses.fields(weight):
                value = getattr(weight, field.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"{name}{SEP}{field.name}"] = value
                    info["tensors"].append(field.name)  # type: ignore[attr-defined]
                else:
                    info[field.name] = list(value) if isinstance(value, tuple) else value
            layers[name] = info
        tensors.update((name, p.data) for name, p in model.named_parameters())
        meta = json.dumps({"key": self.key_text, "layers": layers})
        staging = self.folder.with_name(f"{self.folder.name}.{os.getpid()}.tmp")
        try:
            staging.mkdir(parents=True, exist_ok=True)
            with open(staging / FILE, "wb") as out:
                write_safetensors(out, tensors, {META: meta})
            if self.folder.exists():  # a corrupt one read before: replaced
                shutil.rmtree(self.folder)
            os.replace(staging, self.folder)
        except OSError as exc:  # a full or read-only disk: this start is unaffected
            logger.warning("quantized weights not cached in %s (%s)", self.folder, exc)
            shutil.rmtree(staging, ignore_errors=True)

    def load(
        self, source: str, dtype: torch.dtype, backend: AttentionBackend, ops: LayerOps, quant: QuantConfig
    ) -> LlamaForCausalLM:
        """The model built from the cache (CPU); a CacheMismatch or OSError when it does not read back."""
        try:
            with safe_open(str(self.file), framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {}).get(META, "{}"))
                if meta.get("key") != self.key_text:
                    raise CacheMismatch("written for another checkpoint or settings")
                with torch.device("cpu"):
                    model = LlamaForCausalLM(read_model_config(source), backend, quant=quant, dtype=dtype, ops=ops)
                _fill(model, f, meta["layers"])
        except (CacheMismatch, OSError):
            raise
        except Exception as exc:  # a truncated file (SafetensorError), a malformed header or entry
            raise CacheMismatch(f"{type(exc).__name__}: {exc}") from None
        return model


def _fill(model: LlamaForCausalLM, f: Any, layers: dict[str, dict[str, object]]) -> None:
    """Each quantized layer its cached weights, then every parameter its tensor, then the loader's finish."""
    quantized = dict(model.quantized_layers())
    if set(quantized) != set(layers):
        raise CacheMismatch(f"quantized layers differ ({len(quantized)} in the model, {len(layers)} cached)")
    for name, layer in quantized.items():
        info = dict(layers[name])
        cls = FORMATS[str(info.pop("format"))]
        fields = {t: _read(f, f"{name}{SEP}{t}") for t in info.pop("tensors")}
        fields |= {k: tuple(v) if isinstance(v, list) else v for k, v in info.items()}
        weight = cls(**fields)
        if tuple(weight.shape) != (layer.output_size, layer.input_size):
            want = (layer.output_size, layer.input_size)
            raise CacheMismatch(f"{name}: cached {tuple(weight.shape)}, the model's {want}")
        layer.quantized = weight  # type: ignore[assignment]
        del layer.weight
    model.finish_loading()  # a tied table whose head is quantized: dropped, as after a load
    params = dict(model.named_parameters())
    cached = {k for k in f.keys() if SEP not in k}  # noqa: SIM118 (a safetensors handle, not a dict)
    if cached != set(params):
        raise CacheMismatch(f"parameters differ: {sorted(cached ^ set(params))[:3]}")
    for name, param in params.items():
        tensor = _read(f, name)
        if tensor.shape != param.shape or tensor.dtype != param.dtype:
            raise CacheMismatch(f"{name}: cached {tensor.dtype} {tuple(tensor.shape)}, the model's {param.dtype}")
        param.data = tensor
    for module in model.modules():
        if isinstance(module, LinearBase) and not isinstance(module.linear_method, QuantizedLinearMethod):
            module.process_weights_after_loading()
    model.init_rotary(torch.device("cpu"))
    model.requires_grad_(False)
    model.eval()


def _read(f: Any, name: str) -> torch.Tensor:
    """Tensor `name` of the open cache file: a view of its mapping, or a copy where it is under a huge
    page (a small tensor left in the mapping would keep the whole file resident beside the copies)."""
    tensor: torch.Tensor = f.get_tensor(name)
    return tensor.clone() if tensor.numel() * tensor.element_size() < HUGE_PAGE else tensor


def write_safetensors(out: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format, written a tensor at a time: an 8-byte little-endian header length, the
    JSON header (each tensor's dtype, shape and byte range; padded with spaces to 8 bytes), the bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(len(text).to_bytes(8, "little") + text)
    for t in tensors.values():
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            out.write(memoryview(flat.view(torch.uint8).numpy()))


def cache_for(source: object, quant: QuantConfig, dtype: torch.dtype, device: torch.device) -> QuantizedCache | None:
    """The cache of this build, or None where it does not apply: a model folder (not a GGUF file), on
    the CPU, whose layers some method quantizes at load (not a checkpoint stored quantized)."""
    if not isinstance(source, str | Path) or is_gguf(source) or device.type != "cpu":
        return None
    methods = [m for m in (quant.layers, quant.head) if isinstance(m, QuantizedLinearMethod) and not m.prequantized]
    if not methods or read_model_config(source).sparsity is not None:
        return None
    folder = Path(source)
    files = sorted([*weight_files(folder), folder / "config.json"])
    parts = [f"tokenmill quantized cache {FORMAT}", str(folder.resolve()), str(dtype), quant.describe()]
    parts += [f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files]
    parts += [m.cache_tag() for m in methods]
    parts.append("quantize.py " + hashlib.sha256(Path(quantize.__file__).read_bytes()).hexdigest()[:16])
    text = "\n".join(parts)
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    return QuantizedCache(cache_root() / key, text)


def cache_root() -> Path:
    """`$TOKENMILL_QUANTIZED_CACHE_DIR` (the weights elsewhere: another disk), else `$TOKENMILL_CACHE_DIR/quantized`."""
    return cache_dir("quantized")
