"""Small GGUF files for the tests, written with the `gguf` package's writer as llama.cpp's converter
lays them out: a Hugging Face folder's config as metadata, its tokenizer as `tokenizer.ggml.*`, its
tensors under llama.cpp's names with the Q/K rows permuted, in one tensor type for every matrix
(norms stay F32), or a type per tensor as llama.cpp's mixes choose them (`q4_k_m_types`). Where `gguf`
cannot quantize a type (the K-quants), the matrices are raw blocks of random bits with small finite
scales: both loaders dequantize the same bits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tokenmill.models.gguf_checkpoint import BLOCK_TENSORS, GLOBAL_TENSORS, permute_rotary_rows

Q = gguf.GGMLQuantizationType
# K-quant block layouts: (bytes per 256 weights, byte offsets of the float16 scales in a block)
# (and the other 256-weight types written as raw bits: Q3_K, Q2_K and IQ4_XS, which are read dequantized
# only; TQ1_0, which is not read)
K_QUANT_BLOCKS = {
    **{"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "Q3_K": (110, (108,))},
    **{"Q2_K": (84, (80, 82)), "IQ4_XS": (136, (0,)), "TQ1_0": (54, (52,))},
}
HF_TO_GGUF = {v: k for k, v in GLOBAL_TENSORS.items()} | {v: k for k, v in BLOCK_TENSORS.items()}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}"
    return HF_TO_GGUF[hf_name]


def raw_k_quant_rows(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random K-quant blocks whose float16 scales are small and finite. Q4_K's and Q5_K's
    minimums centre each run (min = scale: the same 6-bit value, dmin = d times the middle q), so the
    weights average about zero as a trained model's do (a model of same-signed weights amplifies any
    rounding of its activations layer by layer)."""
    size, scale_offsets = K_QUANT_BLOCKS[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=(rows, cols // 256)).astype(np.float16)
    for offset in scale_offsets:  # (Q2_K's second: its dmin)
        blocks[:, :, offset : offset + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    if type_name in ("Q4_K", "Q5_K"):
        blocks[:, :, 8:12] = blocks[:, :, 4:8]  # the mins' 6-bit codes equal the scales'
        low = blocks[:, :, 12:16] & 15
        blocks[:, :, 12:16] = low | (low << 4)
        middle = 7.5 if type_name == "Q4_K" else 15.5
        blocks[:, :, 2:4] = (d.astype(np.float32) * middle).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def q4_k_m_types(k_quant: str = "Q4_K", tied: bool = False) -> Callable[[str, tuple[int, ...]], str]:
    """llama.cpp's Q4_K_M mix (`k_quant` Q5_K: Q5_K_M), simplified: the value and down projections and
    the output projection (a tied table: the table) in Q6_K, the rest in `k_quant`; a row width that is
    not a multiple of 256 falls back as llama.cpp's does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0."""
    fallback = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

    def choose(gguf_tensor: str, shape: tuple[int, ...]) -> str:
        high = gguf_tensor.endswith(("attn_v.weight", "ffn_down.weight")) or gguf_tensor == "output.weight"
        high = high or (tied and gguf_tensor == "token_embd.weight")
        wanted = "Q6_K" if high else k_quant
        return wanted if shape[1] % 256 == 0 else fallback[wanted]

    return choose


def encode_tensor(array: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    qtype = Q[type_name]
    if type_name == "F32":
        return array.astype(np.float32), qtype
    if type_name == "F16":
        return array.astype(np.float16), qtype
    if type_name in K_QUANT_BLOCKS:
        return raw_k_quant_rows(array.shape[0], array.shape[1], type_name, rng), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def add_tokenizer(w: gguf.GGUFWriter, folder: Path, pre: str) -> None:
    """`folder`'s byte-level BPE tokenizer (vocabulary, merges, special ids, chat template) as GGUF keys."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    if tok.pad_token_id is not None:
        w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def write_gguf(
    folder: Path,
    out: Path,
    type_name: str | Callable[[str, tuple[int, ...]], str] = "F32",
    pre: str = "gpt-2",
    arch: str = "llama",
    seed: int = 0,
    drop_keys: tuple[str, ...] = (),
    set_keys: dict[str, int] | None = None,
    untie: bool = False,
) -> Path:
    """The model folder `folder` (a Llama with a byte-level BPE tokenizer) as the GGUF file `out`;
    `type_name`: every matrix's type, or (GGUF tensor name, shape) -> its type; `drop_keys`: metadata
    keys left out, `set_keys`: integer keys given other values (to test what such a file does);
    `untie`: a tied folder's table written as the output projection too (an untied file)."""
    cfg = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(seed)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default":
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_vocab_size(cfg["vocab_size"])
    add_tokenizer(w, folder, pre)

    for key in drop_keys:
        del w.kv_data[0][key]
    for key, value in (set_keys or {}).items():
        w.kv_data[0][key] = gguf.GGUFValue(value, gguf.GGUFValueType.UINT32)

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(file))
    if untie and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    for name, tensor in weights.items():
        t = tensor.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):  # llama.cpp permutes llama's only
            t = permute_rotary_rows(t, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_rotary_rows(t, kv_heads)
        array = t.numpy()
        if array.ndim != 2:
            data, qtype = array, Q.F32
        else:
            kind = type_name(gguf_name(name), array.shape) if callable(type_name) else type_name
            data, qtype = encode_tensor(array, kind, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def reference_model(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader on `path`, in float32 (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
