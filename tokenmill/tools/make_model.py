"""`tokenmill make-model`: complete Hugging Face model folders with random weights, built offline.

Owns the size presets (`tiny` for unit tests, `small` = the peer model of shared/PEERS.md) and the
per-family feature coverage of the tiny configs (GQA, MQA, head_dim != hidden / heads, q/k/v biases,
q/k norms, llama3 and yarn RoPE scaling, sliding window). Weights come from transformers' own model
classes, so the folder is exactly what `AutoModelForCausalLM.from_pretrained` expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.models.train_tokenizer import SpecialTokens, save_tokenizer, train_bpe

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "small")
# an embedding model's pooling, as sentence-transformers' Pooling module names it
ST_POOLING_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


@dataclass(frozen=True)
class SizePreset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    initializer_range: float
    tokenizer_corpus_bytes: int


PRESETS = {
    # A few million parameters. The larger init scale keeps attention far from uniform, so a
    # wrong mask, position or cache slot changes the logits well beyond the test tolerance.
    "tiny": SizePreset(4096, 128, 352, 3, 4, 2, 512, 0.1, 1_000_000),
    # The peer model of shared/PEERS.md: 54.9M parameters untied.
    "small": SizePreset(32000, 512, 1376, 8, 8, 2, 2048, 0.02, 8_000_000),
}


def family_overrides(arch: str, size: str) -> dict[str, Any]:
    """Per-family config fields; the tiny configs cover each family's distinctive features."""
    if size != "tiny":
        return {"rope_theta": 10000.0} if arch in ("llama", "mistral") else {}
    if arch == "llama":  # Llama 3.1 RoPE scaling, with a short original context so it bites
        return {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        }
    if arch == "mistral":  # MQA (one KV head) and a sliding window shorter than the test prompts
        return {"num_key_value_heads": 1, "sliding_window": 24}
    if arch == "qwen2":  # q/k/v biases are built in; yarn RoPE scaling as Qwen2.5 long-context
        return {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        }
    # qwen3: q/k norms are built in; head_dim differs from hidden / heads (128 / 4 = 32)
    return {"head_dim": 48, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}


def build_config(arch: str, size: str, tie_embeddings: bool, bos: int, eos: int, pad: int) -> Any:
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {', '.join(SIZES)}, got {size!r}")
    p = PRESETS[size]
    fields: dict[str, Any] = {
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": p.initializer_range,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "head_dim": p.hidden_size // p.num_attention_heads,
    }
    overrides = family_overrides(arch, size)
    if "rope_theta" in overrides:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": overrides.pop("rope_theta")}
    fields.update(overrides)
    if arch == "mistral" and "sliding_window" not in fields:
        fields["sliding_window"] = None
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    return cls(**fields)


def make_model(
    arch: str,
    size: str,
    out: Path,
    seed: int = 0,
    tie_embeddings: bool = False,
    max_shard_size: str | None = None,
    pooling: str | None = None,
) -> Path:
    """Write a complete model folder to `out` and return it. Deterministic for a given seed. `pooling`
    (last, mean, cls): an embedding model, with sentence-transformers' pooling config (normalized)."""
    import torch
    import transformers

    if size not in PRESETS:
        raise ValueError(f"size: expected one of {', '.join(SIZES)}, got {size!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
    preset = PRESETS[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specials = SpecialTokens()
    tok = train_bpe(preset.vocab_size, seed, preset.tokenizer_corpus_bytes, specials)
    ids = {s: tok.token_to_id(s) for s in specials.all()}
    config = build_config(arch, size, tie_embeddings, ids[specials.bos], ids[specials.eos], ids[specials.pad])

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[specials.bos],
        eos_token_id=[ids[specials.eos], ids[specials.im_end]],
        pad_token_id=ids[specials.pad],
    )
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    save_tokenizer(tok, out, specials, preset.max_position_embeddings)
    if pooling is not None:
        write_sentence_transformers(out, pooling)
    return out


def write_sentence_transformers(folder: Path, pooling: str, normalize: bool = True) -> None:
    """Make `folder` an embedding model as sentence-transformers saves one: `modules.json` (Transformer,
    Pooling, and Normalize when `normalize`) and `1_Pooling/config.json` with the `pooling` mode
    (last, mean or cls) on."""
    if pooling not in ST_POOLING_MODES:
        raise ValueError(f"pooling: expected one of {', '.join(ST_POOLING_MODES)}, got {pooling!r}")
    folder = Path(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    modes = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    modes[ST_POOLING_MODES[pooling]] = True
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes, indent=2))
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)


def describe(folder: Path) -> str:
    """A one-line summary of a written folder, for the CLI."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    shards = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    return (
        f"{cfg['model_type']}: vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} q / "
        f"{cfg['num_key_value_heads']} kv heads, tied={cfg.get('tie_word_embeddings', False)}, "
        f"{len(shards)} safetensors file(s) in {folder}"
    )
