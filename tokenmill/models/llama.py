"""The Llama family forward (Llama 2/3, Mistral, Qwen2, Qwen3), written once.

Owns the modules (fused QKV and gate/up projections, RMSNorm, RoPE, SwiGLU MLP, GQA/MQA attention
through an injected `AttentionBackend`) and the map from Hugging Face checkpoint tensor names to
slices of tokenmill's fused parameters. The forward takes a flat batch of several sequences' tokens
and a paged KV cache per layer; all attention metadata comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.config import ModelConfig


@dataclass(frozen=True)
class WeightSlot:
    """Where a checkpoint tensor goes: rows [row_start, row_start + shape[0]) of parameter `param`."""

    param: str
    row_start: int
    shape: tuple[int, ...]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

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
    """Token ids of a flat batch -> hidden states; hidden states -> float32 logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_layout(self) -> dict[str, WeightSlot]:
        """Hugging Face tensor name -> the slice of a tokenmill parameter it fills."""
        cfg = self.config
        h, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
        slots = {
            "model.embed_tokens.weight": WeightSlot("embed_tokens.weight", 0, (cfg.vocab_size, h)),
            "model.norm.weight": WeightSlot("norm.weight", 0, (h,)),
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = WeightSlot("lm_head.weight", 0, (cfg.vocab_size, h))
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}", f"layers.{i}"
            proj = {
                "self_attn.q_proj": ("self_attn.qkv_proj", 0, q, h, cfg.qkv_bias),
                "self_attn.k_proj": ("self_attn.qkv_proj", q, kv, h, cfg.qkv_bias),
                "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv, h, cfg.qkv_bias),
                "self_attn.o_proj": ("self_attn.o_proj", 0, h, q, cfg.o_bias),
                "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter, h, cfg.mlp_bias),
                "mlp.up_proj": ("mlp.gate_up_proj", inter, inter, h, cfg.mlp_bias),
                "mlp.down_proj": ("mlp.down_proj", 0, h, inter, cfg.mlp_bias),
            }
            for name, (param, start, rows, cols, bias) in proj.items():
                slots[f"{src}.{name}.weight"] = WeightSlot(f"{dst}.{param}.weight", start, (rows, cols))
                if bias:
                    slots[f"{src}.{name}.bias"] = WeightSlot(f"{dst}.{param}.bias", start, (rows,))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                slots[f"{src}.{norm}.weight"] = WeightSlot(f"{dst}.{norm}.weight", 0, (h,))
            if cfg.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    slots[f"{src}.self_attn.{norm}.weight"] = WeightSlot(f"{dst}.self_attn.{norm}.weight", 0, (d,))
        return slots
