"""The Llama family forward (Llama 2/3, Mistral, Qwen2, Qwen3), written once.

Owns the modules (fused QKV and gate/up projections, RMSNorm, RoPE, SwiGLU MLP, GQA/MQA attention
through an injected `AttentionBackend`) and the map from Hugging Face checkpoint tensor names to
tokenmill's parameters and their shards. Every projection (and an untied lm_head) is a
`layers.linear` layer whose `LinearMethod` is injected too (default: unquantized). The forward takes
a flat batch of several sequences' tokens and a paged KV cache per layer; all attention metadata
comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tokenmill.layers.linear import Linear, LinearMethod, MergedLinear, ShardId, UnquantizedLinearMethod
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.config import ModelConfig

# tokenmill's fused projections -> the checkpoint projections stacked in them, in output order, each
# with the shard id its weight loader takes
STACKED_PROJECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", "gate"), ("up_proj", "up")),
}


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: shard `shard_id` of tokenmill parameter `param` (None: all of it)."""

    param: str
    shard_id: ShardId


def rms_norm(dim: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(dim, eps).to(dtype)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, backend: AttentionBackend, method: LinearMethod, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        shards = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
        self.qkv_proj = MergedLinear(cfg.hidden_size, shards, bias=cfg.qkv_bias, linear_method=method, dtype=dtype)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, linear_method=method, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        # q and k heads side by side: one rotation for both
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, method: LinearMethod, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.intermediate_size = inter
        shards = {"gate": inter, "up": inter}
        self.gate_up_proj = MergedLinear(h, shards, bias=cfg.mlp_bias, linear_method=method, dtype=dtype)
        self.down_proj = Linear(inter, h, bias=cfg.mlp_bias, linear_method=method, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, backend: AttentionBackend, method: LinearMethod, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, backend, method, dtype)
        self.post_attention_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, method, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Token ids of a flat batch -> hidden states; hidden states -> float32 logits.

    Parameters are created uninitialized (the loader fills them) in `dtype`, on the ambient device
    (build it under `with torch.device(...)`); `linear_method` holds and applies every projection's
    and the untied lm_head's weights (None: unquantized)."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        *,
        linear_method: LinearMethod | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = cfg
        method = linear_method or UnquantizedLinearMethod()
        table = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)  # uninitialized: the loader fills it
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, method, dtype) for i in range(cfg.num_layers))
        self.norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, linear_method=method, dtype=dtype)

    def init_rotary(self, device: torch.device) -> None:
        """Build the RoPE tables; called once the parameters live on their device."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, padding included
        positions: torch.Tensor,  # [T] int64, position of each token in its sequence
        kv_caches: list[KVCache],  # one per layer
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, cache, metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        if self.config.tie_word_embeddings:
            return F.linear(hidden, self.embed_tokens.weight).float()
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def checkpoint_map(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> the parameter (and shard of it) it fills. Derived from the
        parameters the model has, so a LinearMethod's own parameters (named after the checkpoint's
        suffixes) are mapped too; a tied lm_head has none, and so no entry."""
        targets: dict[str, WeightTarget] = {}
        for name, _ in self.named_parameters():
            prefix = "" if name.startswith("lm_head.") else "model."
            module, _, suffix = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf in STACKED_PROJECTIONS:
                for source, shard_id in STACKED_PROJECTIONS[leaf]:
                    targets[f"{prefix}{parent}.{source}.{suffix}"] = WeightTarget(name, shard_id)
            else:
                targets[prefix + name] = WeightTarget(name, None)
        return targets
