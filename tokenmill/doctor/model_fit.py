"""Question 1, model fit: weights and KV cache in the memory budget, against what the trace needs.

Weight bytes per way of storing them come from the model's parameter count (its config: the linear
layers, the embedding, the head, the norms) times each way's bytes per parameter: 4 (float32), 2
(bfloat16, float16), and for quantized linear layers 1 (int8: its per-row scales are negligible)
or 0.5 + two float16 values a group of 32 (int4), the embedding and norms staying in 16 bits. KV bytes
per token are layers x KV heads x head_dim x 2 (K and V) x the cache's bytes per value (an int8 cache
adds a float32 scale per token and KV head). What is left of the budget after the weights and an
activation reserve (one full step's largest activations, in float32) holds the KV cache. The trace
needs, at the least, its largest request (prompt + max_tokens), and to run as scheduled, the peak of
KV tokens the simulator's replay held with room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.doctor.findings import Finding
from tokenmill.models.config import ModelConfig

# way of storing the weights -> (the EngineConfig settings that select it, bytes per linear parameter,
# bytes per other parameter)
STORAGE = {
    "float32": ({"dtype": "float32", "quantization": "none"}, 4.0, 4.0),
    "bfloat16": ({"dtype": "bfloat16", "quantization": "none"}, 2.0, 2.0),
    "int8": ({"dtype": "bfloat16", "quantization": "int8"}, 1.0, 2.0),
    "int4": ({"dtype": "bfloat16", "quantization": "int4"}, 0.5 + 4 / 32, 2.0),
}


@dataclass
class ParameterCount:
    linear: int  # parameters in the matrices a quantization method stores quantized (layers and head)
    other: int  # embedding, norms, biases

    @property
    def total(self) -> int:
        return self.linear + self.other


def count_parameters(cfg: ModelConfig) -> ParameterCount:
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    linear = cfg.num_layers * per_layer + (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    biases = cfg.num_layers * ((q + 2 * kv) * cfg.qkv_bias + h * cfg.o_bias)
    norms = cfg.num_layers * (2 * h + 2 * cfg.head_dim * cfg.qk_norm) + h
    return ParameterCount(linear, cfg.vocab_size * h + biases + norms)


def weight_bytes(params: ParameterCount, storage: str) -> int:
    _, linear, other = STORAGE[storage]
    return int(params.linear * linear + params.other * other)


def kv_bytes_per_token(cfg: ModelConfig, value_bytes: float) -> float:
    """value_bytes: 4, 2, or 1 for an int8 cache (whose per-token, per-head float32 scale is added)."""
    per_head = cfg.head_dim * value_bytes + (4 if value_bytes == 1 else 0)
    return cfg.num_layers * cfg.num_kv_heads * per_head * 2


def activation_reserve(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """Bytes one full step's largest activations take (float32): the MLP's two intermediate tensors and a
    few hidden-sized ones per token; the logits are taken for sampling rows only."""
    return max_num_batched_tokens * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * 4


@dataclass
class FitRow:
    storage: str
    weight_bytes: int
    kv_tokens: int  # KV tokens the rest of the budget holds (0 if the weights do not fit)

    def fits(self, tokens: int) -> bool:
        return self.kv_tokens >= tokens


def fit_table(
    cfg: ModelConfig, params: ParameterCount, memory: int, kv_value_bytes: float, max_num_batched_tokens: int
) -> list[FitRow]:
    reserve = activation_reserve(cfg, max_num_batched_tokens)
    per_token = kv_bytes_per_token(cfg, kv_value_bytes)
    rows = []
    for storage in STORAGE:
        w = weight_bytes(params, storage)
        rows.append(FitRow(storage, w, max(0, int((memory - w - reserve) // per_token))))
    return rows


def fit_finding(
    cfg: ModelConfig,
    current: str,
    memory: int,
    kv_value_bytes: float,
    max_num_batched_tokens: int,
    largest_request: int,
    peak_tokens: int,
    max_num_seqs: int,
) -> Finding:
    """`current`: how the weights are stored now (a STORAGE key); `largest_request`: the trace's largest
    prompt + max_tokens; `peak_tokens`: the KV tokens the replay held at most with room to spare."""
    params = count_parameters(cfg)
    rows = fit_table(cfg, params, memory, kv_value_bytes, max_num_batched_tokens)
    by = {r.storage: r for r in rows}
    now = by[current]
    per_token = kv_bytes_per_token(cfg, kv_value_bytes)
    gib = 2**30
    evidence = [
        f"{params.total / 1e6:.1f}M parameters ({params.linear / 1e6:.1f}M in linear layers), from the model's config",
        f"KV cache: {per_token:.0f} bytes a token ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
        f"{cfg.head_dim} x 2 x {kv_value_bytes:g} bytes)",
        "weights / KV tokens left in the budget of "
        f"{memory / gib:.2f} GiB: "
        + ", ".join(f"{r.storage} {r.weight_bytes / gib:.2f} GiB / {r.kv_tokens:,}" for r in rows),
        f"the trace's largest request: {largest_request:,} tokens; its peak KV use in the replay at "
        f"max_num_seqs {max_num_seqs}: {peak_tokens:,} tokens",
    ]
    if now.fits(peak_tokens):
        return Finding(
            "1. Model fit",
            f"fits: {current} weights leave room for {now.kv_tokens:,} KV tokens, the trace peaks at {peak_tokens:,}",
            evidence,
        )
    # the least lossy storage that holds the peak, else the largest request
    order = list(STORAGE)[list(STORAGE).index(current) :]
    choice = next((s for s in order if by[s].fits(peak_tokens)), None) or next(
        (s for s in order if by[s].fits(largest_request)), None
    )
    if choice is None:
        return Finding(
            "1. Model fit",
            f"does not fit: even int4 weights leave {by['int4'].kv_tokens:,} KV tokens, the largest request needs "
            f"{largest_request:,}",
            evidence,
            pitfalls=["a larger memory budget, a shorter max_model_len or a smaller model is needed"],
        )
    settings: dict[str, Any] = dict(STORAGE[choice][0])
    kv_memory = int(by[choice].kv_tokens * per_token)
    settings["kv_cache_memory"] = kv_memory
    if now.weight_bytes + activation_reserve(cfg, max_num_batched_tokens) > memory:
        verdict = f"{current} weights ({now.weight_bytes / gib:.2f} GiB) do not fit the budget: store them as {choice}"
    elif not now.fits(largest_request):
        verdict = f"{current} weights leave {now.kv_tokens:,} KV tokens, less than the largest request: use {choice}"
    else:
        verdict = (
            f"{current} weights leave {now.kv_tokens:,} KV tokens, the trace peaks at {peak_tokens:,} (requests "
            f"wait or are preempted): {choice} leaves {by[choice].kv_tokens:,}"
        )
    return Finding(
        "1. Model fit",
        verdict,
        evidence,
        settings,
        pitfalls=[
            f"{choice} changes the outputs: measure its quality cost with `tokenmill eval-quant` before serving it"
        ]
        if choice not in ("float32", "bfloat16")
        else [],
    )
