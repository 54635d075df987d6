"""`config.json` -> `ModelConfig`: the one validated description of a Llama-family model.

Owns parsing and validation of Hugging Face configs of the Llama, Mistral, Qwen2 and Qwen3 families,
in both the transformers 4 layout (`rope_theta` + `rope_scaling`, `torch_dtype`) and the 5 layout
(`rope_parameters`, `dtype`, `layer_types`). Every error names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.layers.rotary import SUPPORTED_ROPE_TYPES, RopeConfig
from tokenmill.model_files import ModelLoadError
from tokenmill.quant.checkpoint import (
    CHECKPOINT_QUANTIZATIONS,
    SPARSITY_FORMATS,
    CheckpointQuantization,
    CheckpointSparsity,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# base models without an output projection (embedding models saved as such, e.g. e5-mistral's MistralModel):
# the family's, with the embedding table standing in for the head (their logits mean nothing; they embed)
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # per layer: attend to the last `window` positions only, or None for full causal attention
    sliding_windows: tuple[int | None, ...]
    dtype: str | None  # the checkpoint's dtype as config.json states it
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: CheckpointQuantization | None = None  # config.json's quantization_config (AWQ, GPTQ)
    sparsity: CheckpointSparsity | None = None  # its quantization_config.sparsity_config (compressed-tensors 2:4)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class _Fields:
    """Typed access to a raw config dict; errors name the file and the field."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw = raw
        self.where = where

    def error(self, field: str, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: field '{field}' {msg}")

    def get(self, field: str, kind: type | tuple[type, ...], default: Any = ..., allow_none: bool = False) -> Any:
        if field not in self.raw or (self.raw[field] is None and not allow_none and default is not ...):
            if default is ...:
                raise self.error(field, "is missing")
            return default
        value = self.raw[field]
        if value is None and allow_none:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and kind is not bool:
            raise self.error(field, f"must be {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise self.error(field, f"must be {_kind_name(kind)}, got {value!r}")
        return value

    def positive_int(self, field: str, default: Any = ...) -> int:
        value: int = self.get(field, int, default)
        if value <= 0:
            raise self.error(field, f"must be a positive integer, got {value}")
        return value


def _parse_quantization(f: _Fields) -> CheckpointQuantization | None:
    raw = f.get("quantization_config", dict, default=None, allow_none=True)
    if raw is None:
        return None
    q = _Fields(raw, f.where)
    field = "quantization_config"
    method = q.get("quant_method", str, default=None)
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise f.error(f"{field}.quant_method", f"is {method!r}; tokenmill loads {', '.join(CHECKPOINT_QUANTIZATIONS)}")
    if method == "compressed-tensors":
        if not raw.get("config_groups") and raw.get("sparsity_config"):
            return None  # sparse only (_parse_sparsity)
        return _parse_compressed_tensors(f, q)
    bits = q.get("bits", int, default=q.get("w_bit", int, default=None))
    if bits not in ((4,) if method == "awq" else (4, 8)):
        raise f.error(f"{field}.bits", f"is {bits!r}; tokenmill loads 4-bit {method} checkpoints (gptq: 8-bit too)")
    group = q.get("group_size", int, default=q.get("q_group_size", int, default=128))
    if group != -1 and (group < 32 or group & (group - 1)):
        raise f.error(f"{field}.group_size", f"is {group}; tokenmill loads groups of a power of two from 32, or -1")
    if method == "awq":
        version = q.get("version", str, default="gemm").lower()
        if version != "gemm":
            raise f.error(f"{field}.version", f"is {version!r}; tokenmill loads AWQ's GEMM packing")
        if not q.get("zero_point", bool, default=True):
            raise f.error(f"{field}.zero_point", "is false; tokenmill loads AWQ checkpoints with zero points")
    desc_act = method == "gptq" and q.get("desc_act", bool, default=False)
    v2 = method == "gptq" and q.get("checkpoint_format", str, default="gptq") == "gptq_v2"
    return CheckpointQuantization(method, bits, None if group == -1 else group, v2, desc_act=desc_act)


def _parse_sparsity(f: _Fields) -> CheckpointSparsity | None:
    """compressed-tensors' `quantization_config.sparsity_config`: 2:4, stored sparse-24-bitmask or dense."""
    raw = f.get("quantization_config", dict, default=None, allow_none=True)
    if raw is None or not raw.get("sparsity_config"):  # (an empty one: none)
        return None
    field = "quantization_config.sparsity_config"
    if raw.get("quant_method") != "compressed-tensors":
        raise f.error(field, "is set outside a compressed-tensors quantization_config")
    if raw.get("config_groups"):  # quantized and 2:4 (llm-compressor's 2:4 W4A16...): loaded as quantized, dense
        return None
    sp = _Fields(raw["sparsity_config"] if isinstance(raw["sparsity_config"], dict) else {}, f.where)
    fmt = sp.get("format", str)
    if fmt not in SPARSITY_FORMATS:
        raise f.error(f"{field}.format", f"is {fmt!r}; tokenmill loads {', '.join(SPARSITY_FORMATS)}")
    structure = sp.get("sparsity_structure", str, default="2:4")
    if structure != "2:4":
        raise f.error(f"{field}.sparsity_structure", f"is {structure!r}; tokenmill loads 2:4")
    return CheckpointSparsity(fmt, structure)


def _parse_compressed_tensors(f: _Fields, q: _Fields) -> CheckpointQuantization:
    """compressed-tensors' `quantization_config`: one config group of integer weights, pack-quantized,
    per group or per channel, no activation quantization."""
    field = "quantization_config"
    groups = q.get("config_groups", dict)
    if len(groups) != 1:
        raise f.error(f"{field}.config_groups", f"has {len(groups)} groups; tokenmill loads one")
    name, group = next(iter(groups.items()))
    where = f"{field}.config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise f.error(f"{where}.weights", "is missing")
    fmt = group.get("format") or q.get("format", str, default=None)
    if fmt != "pack-quantized":
        raise f.error(f"{field}.format", f"is {fmt!r}; tokenmill loads compressed-tensors' pack-quantized format")
    if group.get("input_activations") is not None:
        raise f.error(f"{where}.input_activations", "is set: quantized activations are not supported yet")
    w = _Fields(group["weights"], f.where)
    bits, kind = w.get("num_bits", int), w.get("type", str, default="int")
    symmetric = w.get("symmetric", bool, default=True)
    if kind != "int" or bits not in (4, 8) or (bits == 8 and not symmetric):
        what = f"are {bits}-bit {kind} (symmetric: {symmetric}); tokenmill loads int4, and symmetric int8"
        raise f.error(f"{where}.weights", what)
    strategy = w.get("strategy", str, default="channel")
    if strategy not in ("group", "channel"):
        raise f.error(f"{where}.weights.strategy", f"is {strategy!r}; tokenmill loads group and channel")
    size = w.get("group_size", int) if strategy == "group" else None
    if size is not None and (size < 32 or size & (size - 1)):
        raise f.error(f"{where}.weights.group_size", f"is {size}; tokenmill loads groups of a power of two from 32")
    return CheckpointQuantization("compressed-tensors", bits, size, symmetric=symmetric)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _parse_rope(f: _Fields, max_pos: int) -> RopeConfig:
    if "rope_parameters" in f.raw and f.raw["rope_parameters"] is not None:
        field = "rope_parameters"
        params = f.get(field, dict)
        theta_default = params.get("rope_theta", f.raw.get("rope_theta", 10000.0))
    else:
        field = "rope_scaling"
        params = f.get(field, dict, default={}, allow_none=True) or {}
        theta_default = f.get("rope_theta", float, default=10000.0)
    p = _Fields(params, f.where)
    p_name = f"{field}.rope_type"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise f.error(p_name, f"must be a string, got {rope_type!r}")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.error(p_name, f"is {rope_type!r}; tokenmill supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = float(theta_default)
    if theta <= 0:
        raise f.error("rope_theta", f"must be positive, got {theta}")
    if rope_type == "default":
        return RopeConfig("default", theta)
    factor = p.get("factor", float)
    if factor <= 0:
        raise f.error(f"{field}.factor", f"must be positive, got {factor}")
    orig = params.get("original_max_position_embeddings") or max_pos
    if not isinstance(orig, int) or orig <= 0:
        raise f.error(f"{field}.original_max_position_embeddings", f"must be a positive integer, got {orig!r}")
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=factor)
    if rope_type == "llama3":
        return RopeConfig(
            "llama3",
            theta,
            factor=factor,
            low_freq_factor=p.get("low_freq_factor", float),
            high_freq_factor=p.get("high_freq_factor", float),
            original_max_position_embeddings=orig,
        )
    return RopeConfig(
        "yarn",
        theta,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=p.get("beta_fast", float, default=32.0),
        beta_slow=p.get("beta_slow", float, default=1.0),
        attention_factor=p.get("attention_factor", float, default=None, allow_none=True),
        mscale=p.get("mscale", float, default=None, allow_none=True),
        mscale_all_dim=p.get("mscale_all_dim", float, default=None, allow_none=True),
        truncate=p.get("truncate", bool, default=True),
    )


def _parse_sliding_windows(f: _Fields, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = f.get("sliding_window", int, default=None, allow_none=True)
    if arch.startswith("Qwen") and not f.get("use_sliding_window", bool, default=False):
        window = None  # Qwen configs carry a sliding_window that only applies when enabled
    if window is not None and window <= 0:
        raise f.error("sliding_window", f"must be a positive integer, got {window}")
    layer_types = f.get("layer_types", list, default=None, allow_none=True)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise f.error("layer_types", f"has {len(layer_types)} entries for {num_layers} layers")
        windows: list[int | None] = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                if window is None:
                    raise f.error(f"layer_types[{i}]", "is 'sliding_attention' but 'sliding_window' is not set")
                windows.append(window)
            else:
                raise f.error(f"layer_types[{i}]", f"is {kind!r}; expected 'full_attention' or 'sliding_attention'")
        return tuple(windows)
    if arch.startswith("Qwen") and window is not None:
        first = f.get("max_window_layers", int, default=num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return tuple(window for _ in range(num_layers))


def parse_config(raw: Any, where: str) -> ModelConfig:
    """Validate a config.json dict; `where` names the file in errors."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    f = _Fields(raw, where)
    archs = f.get("architectures", list)
    if len(archs) != 1 or archs[0] not in (*SUPPORTED_ARCHITECTURES, *BASE_MODELS):
        supported = ", ".join((*SUPPORTED_ARCHITECTURES, *BASE_MODELS))
        raise f.error("architectures", f"is {archs!r}; tokenmill supports one of {supported}")
    arch = BASE_MODELS.get(archs[0], archs[0])
    act = f.get("hidden_act", str, default="silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}; the Llama family's SwiGLU MLP needs 'silu'")
    hidden = f.positive_int("hidden_size")
    heads = f.positive_int("num_attention_heads")
    kv_heads = f.positive_int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = f.get("head_dim", int, default=None, allow_none=True)
    if head_dim is None:
        if hidden % heads:
            raise f.error("head_dim", f"is missing and hidden_size ({hidden}) is not divisible by heads ({heads})")
        head_dim = hidden // heads
    if head_dim <= 0 or head_dim % 2:
        raise f.error("head_dim", f"must be a positive even integer, got {head_dim}")
    num_layers = f.positive_int("num_hidden_layers")
    max_pos = f.positive_int("max_position_embeddings")
    # Mistral has no biases; Qwen2 has q/k/v biases always; Llama and Qwen3 follow attention_bias.
    attention_bias = f.get("attention_bias", bool, default=False) and arch != "MistralForCausalLM"
    eos = f.get("eos_token_id", (int, list), default=None, allow_none=True)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise f.error("eos_token_id", f"must be an integer or a list of integers, got {eos!r}")
    dtype = f.get("dtype", str, default=None, allow_none=True) or f.get(
        "torch_dtype", str, default=None, allow_none=True
    )
    eps = f.get("rms_norm_eps", float, default=1e-6)
    if eps <= 0:
        raise f.error("rms_norm_eps", f"must be positive, got {eps}")
    return ModelConfig(
        architecture=arch,
        vocab_size=f.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.positive_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=eps,
        rope=_parse_rope(f, max_pos),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, default=False) or archs[0] in BASE_MODELS,
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=attention_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=f.get("mlp_bias", bool, default=False) if arch == "LlamaForCausalLM" else False,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=_parse_sliding_windows(f, arch, num_layers),
        dtype=dtype,
        bos_token_id=f.get("bos_token_id", int, default=None, allow_none=True),
        eos_token_ids=eos_ids,
        quantization=_parse_quantization(f),
        sparsity=_parse_sparsity(f),
    )


def load_config(folder: Path) -> ModelConfig:
    """Read and validate `folder/config.json`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: config.json is missing from the model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e})") from None
    return parse_config(raw, str(path))
