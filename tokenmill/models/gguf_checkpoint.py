"""A GGUF file read as the Hugging Face checkpoint it describes: a config.json dict and named tensors.

Owns mapping llama.cpp's metadata keys (the header as models/gguf_header.py reads it: the `gguf`
package's reader, never a parse by hand, cached after the first start) to the fields of a Hugging
Face `config.json` (validated by the same `parse_config` as a folder's, errors naming the GGUF key),
mapping tensor names (`blk.3.attn_q.weight`) to the model's checkpoint names
(`model.layers.3.self_attn.q_proj.weight`), reading each tensor's bytes from the file into memory of
its own: the float types handed over as stored (the copy into the parameter converts them), every
block type dequantized to float32 with `gguf.quants.dequantize` (the only way the types without a
kernel here, DEQUANTIZED_TYPES, are read), or the matrices the model keeps
quantized handed over as they are (Q8_0 / Q4_0 / Q4_1 in tokenmill's int formats, gguf_blocks.py, or
any block type as its bytes, a `GGUFMatrix`); and undoing the row permutation llama.cpp's converter
applies to a llama model's Q and K projections (it stores each head's rotary pairs interleaved,
`[x0, y0, x1, y1, ...]`, where the Hugging Face layout has `[x0, x1, ..., y0, y1, ...]`). The
tokenizer the file describes is built by `text/tokenizer.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from tokenmill.model_files import ModelLoadError
from tokenmill.models.config import ModelConfig, parse_config
from tokenmill.models.gguf_blocks import decode, pack
from tokenmill.models.gguf_header import StoredTensor, read_header
from tokenmill.quant.gguf_method import GGUFMatrix, row_bytes
from tokenmill.quant.quantize import Int4Weight, Int8Weight

# general.architecture -> the Hugging Face architecture it is (llama.cpp writes Mistral as llama).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types read (names as gguf.GGMLQuantizationType spells them): those the model can keep as stored,
# and those only ever dequantized at load by gguf's dequantizer (no native kernel reads them: Q2_K and
# the i-quants, IQ*), which then take the model dtype's memory.
KEPT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DEQUANTIZED_TYPES = ("Q2_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = KEPT_TYPES + DEQUANTIZED_TYPES
# The float types, handed over as stored (a float16 or bfloat16 value converts to any of the three
# dtypes as it would through float32, exactly: the copy into the parameter does it, once).
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# config.json field -> the GGUF metadata key (after the architecture prefix) that gives it.
CONFIG_KEYS = {
    "num_hidden_layers": "block_count",
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "head_dim": "attention.key_length",
    "sliding_window": "attention.sliding_window",
    "rope_scaling.rope_type": "rope.scaling.type",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
}
REQUIRED = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count")

# GGUF tensor name (within a block, or global) -> the Hugging Face checkpoint name.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file as stored: its GGUF name, its checkpoint name, type and shape."""

    gguf_name: str
    hf_name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a matrix


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows `[x0, y0, x1, y1, ...]` -> `[x0, x1, ..., y0, y1, ...]`.

    w: [num_heads * head_dim, ...] (a weight matrix or a bias vector) -> the same shape.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order from the Hugging Face one (the inverse of `unpermute_rotary_rows`)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """An open GGUF file: `config` (validated), `raw_config` (the config.json it implies), `tensors()`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: GGUF file does not exist")
        header = read_header(self.path)  # (parsed by the `gguf` package's reader once, then cached)
        self.metadata = header.metadata
        stored = header.tensors
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF key 'general.architecture' is missing")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF key 'general.architecture' is {arch!r}; tokenmill loads {', '.join(ARCHITECTURES)}"
            )
        self.arch = arch
        self._stored = {t.name: t for t in stored}
        if "rope_freqs.weight" in self._stored:
            raise ModelLoadError(
                f"{self.path}: tensor 'rope_freqs.weight' (per-frequency rotary factors, as Llama 3.1 files carry) "
                "is not supported"
            )
        self.infos = [self._info(t) for t in stored]
        self.raw_config = self._raw_config()
        try:
            self.config: ModelConfig = parse_config(self.raw_config, str(self.path))
        except ModelLoadError as e:  # name the GGUF key that gave the field
            raise ModelLoadError(self._gguf_key_names(str(e))) from None

    @property
    def tensor_bytes(self) -> int:
        """The bytes the file's tensors take, as stored."""
        return sum(t.n_bytes for t in self._stored.values())

    def key(self, name: str) -> str:
        """The full GGUF metadata key of an architecture-prefixed `name` (`block_count` -> `llama.block_count`)."""
        return f"{self.arch}.{name}"

    def _gguf_key_names(self, message: str) -> str:
        def swap(m: re.Match[str]) -> str:
            field = m.group(1)
            key = CONFIG_KEYS.get(field)
            return f"GGUF key '{self.key(key)}'" if key else m.group(0)

        return re.sub(r"field '([\w.]+)'", swap, message)

    def _meta(self, name: str, kind: type | tuple[type, ...], required: bool) -> Any:
        key = self.key(name)
        if key not in self.metadata:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF key '{key}' is missing")
            return None
        value = self.metadata[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelLoadError(f"{self.path}: GGUF key '{key}' has {value!r}, expected a number")
        return value

    def _info(self, t: StoredTensor) -> GGUFTensorInfo:
        type_name = t.type_name
        if type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor '{t.name}' has type {type_name}; tokenmill reads {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(reversed(t.shape))  # GGUF lists dimensions innermost first
        m = BLOCK_NAME.match(t.name)
        hf = f"model.layers.{m.group(1)}.{BLOCK_TENSORS[m.group(2)]}" if m and m.group(2) in BLOCK_TENSORS else None
        hf = hf or GLOBAL_TENSORS.get(t.name)
        if hf is None:
            raise ModelLoadError(f"{self.path}: unexpected tensor '{t.name}' for a {self.arch} model")
        return GGUFTensorInfo(t.name, hf, type_name, shape)

    def _raw_config(self) -> dict[str, Any]:
        """The config.json this file's metadata describes (keys validated here for presence and type)."""
        raw: dict[str, Any] = {"architectures": [ARCHITECTURES[self.arch]], "hidden_act": "silu"}
        for field, name in CONFIG_KEYS.items():
            if "." in field:  # the rope scaling group, read below
                continue
            value = self._meta(name, (int, float), name in REQUIRED)
            if value is not None:
                raw[field] = value
        raw.setdefault("rms_norm_eps", 1e-5)
        rope_dims = self._meta("rope.dimension_count", int, False)
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        head_dim = raw.get("head_dim") or (hidden // heads if heads else 0)
        if rope_dims is not None and rope_dims != head_dim:
            raise ModelLoadError(
                f"{self.path}: GGUF key '{self.key('rope.dimension_count')}' is {rope_dims}, the head size is "
                f"{head_dim}: partial rotary embeddings are not supported"
            )
        scaling = self.metadata.get(self.key("rope.scaling.type"))
        if scaling not in (None, "none"):
            factor = self._meta("rope.scaling.factor", (int, float), True)
            orig = self._meta("rope.scaling.original_context_length", int, False)
            raw["rope_scaling"] = {"rope_type": scaling, "factor": factor}
            if orig is not None:
                raw["rope_scaling"]["original_max_position_embeddings"] = orig
        if "sliding_window" in raw and self.arch.startswith("qwen"):
            raw["use_sliding_window"] = True
        vocab = self.metadata.get(self.key("vocab_size"))
        if vocab is None and "tokenizer.ggml.tokens" in self.metadata:
            vocab = len(self.metadata["tokenizer.ggml.tokens"])
        embed = next((i for i in self.infos if i.gguf_name == "token_embd.weight"), None)
        if embed is None:
            raise ModelLoadError(f"{self.path}: tensor 'token_embd.weight' is missing")
        raw["vocab_size"] = vocab if vocab is not None else embed.shape[0]
        names = {i.gguf_name for i in self.infos}
        raw["tie_word_embeddings"] = "output.weight" not in names
        raw["attention_bias"] = "blk.0.attn_q.bias" in names
        raw["mlp_bias"] = False
        for field in ("bos_token_id", "eos_token_id"):
            if isinstance(self.metadata.get(f"tokenizer.ggml.{field}"), int):
                raw[field] = self.metadata[f"tokenizer.ggml.{field}"]
        raw["dtype"] = self.native_dtype()
        return raw

    def native_dtype(self) -> str:
        """The dtype 'auto' serves: the matrices' float type where all share one, else float32."""
        types = {i.type_name for i in self.infos if len(i.shape) == 2}
        return {"F16": "float16", "BF16": "bfloat16"}.get(types.pop(), "float32") if len(types) == 1 else "float32"

    def tensors(
        self, keep: dict[str, str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | Int8Weight | Int4Weight | GGUFMatrix]]:
        """(checkpoint name, float tensor in the Hugging Face layout) for every tensor, read one at a
        time: the float types (F32 / F16 / BF16) in their own dtype, the block types dequantized to
        float32; the matrices named in `keep` as they are stored: "int" (Q8_0 / Q4_0 / Q4_1) in
        tokenmill's formats (gguf_blocks.py), "blocks" as a `GGUFMatrix` of the file's bytes."""
        keep = keep or {}
        # the tensors copied into parameters are read through a private mapping of the file: no buffer of
        # their own to allocate and fault in first (a pass over fresh memory a tensor)
        mapped = np.memmap(self.path, dtype=np.uint8, mode="c")
        with open(self.path, "rb") as file:
            for info in self.infos:
                t = self._stored[info.gguf_name]
                how = keep.get(info.hf_name)
                if how is not None:
                    yield info.hf_name, self._kept(file, t, info, how)
                else:
                    yield info.hf_name, self._dequantized(self._mapped(mapped, t), info)

    def _raw(self, file: BinaryIO, t: StoredTensor) -> np.ndarray:
        """A tensor's bytes read into memory of their own."""
        raw = np.empty(t.n_bytes, dtype=np.uint8)
        file.seek(t.data_offset)
        if file.readinto(memoryview(raw)) != raw.size:
            raise ModelLoadError(f"{self.path}: tensor '{t.name}' runs past the end of the file")
        return raw

    def _mapped(self, mapped: np.ndarray, t: StoredTensor) -> np.ndarray:
        """A tensor's bytes as a view of the file's mapping (copied by whoever keeps them)."""
        raw = mapped[t.data_offset : t.data_offset + t.n_bytes]
        if raw.size != t.n_bytes:
            raise ModelLoadError(f"{self.path}: tensor '{t.name}' runs past the end of the file")
        return raw

    def _kept(
        self, file: BinaryIO, t: StoredTensor, info: GGUFTensorInfo, how: str
    ) -> Int8Weight | Int4Weight | GGUFMatrix:
        rows, cols = info.shape[0], info.shape[1]
        heads = self._rotary_heads(info.gguf_name)
        order = unpermute_rotary_rows(torch.arange(rows), heads) if heads else None
        raw = self._raw(file, t)
        try:
            if how == "blocks":
                matrix = GGUFMatrix(info.type_name, torch.from_numpy(raw).view(rows, -1), cols)
                if matrix.data.shape[1] != row_bytes(info.type_name, cols):
                    raise ValueError(
                        f"{info.type_name} data of {raw.size} bytes does not hold a [{rows}, {cols}] matrix"
                    )
                return matrix.permute_rows(order) if order is not None else matrix  # (rows in the HF order)
            blocks = decode(info.type_name, raw, (rows, cols))
        except (ValueError, RuntimeError, KeyError) as e:
            raise ModelLoadError(f"{self.path}: tensor '{info.gguf_name}': {e}") from None
        if order is not None:  # the rows in the Hugging Face order, scales with them
            blocks = blocks.permute_rows(order)
        return pack(blocks)

    def _dequantized(self, raw: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
        import gguf

        if info.type_name in FLOAT_TYPES:  # as stored: the parameter's copy converts it
            tensor = torch.from_numpy(raw).view(FLOAT_TYPES[info.type_name]).reshape(info.shape)
        else:
            try:
                rows = raw.reshape(info.shape[0], -1) if len(info.shape) == 2 else raw  # [N, row bytes]
                array = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[info.type_name])
            except (ValueError, NotImplementedError) as e:
                raise ModelLoadError(f"{self.path}: tensor '{info.gguf_name}' cannot be dequantized ({e})") from None
            tensor = torch.from_numpy(np.asarray(array, dtype=np.float32)).reshape(info.shape)
        heads = self._rotary_heads(info.gguf_name)
        return unpermute_rotary_rows(tensor, heads) if heads else tensor

    def _rotary_heads(self, gguf_name: str) -> int:
        """The heads whose rows llama.cpp's converter permuted in this tensor (0: none)."""
        if self.arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return self.config.num_heads
        if self.arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return self.config.num_kv_heads
        return 0
