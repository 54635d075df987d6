"""The Llama family forward (Llama 2/3, Mistral, Qwen2, Qwen3), written once.

Owns the modules (fused QKV and gate/up projections, RMSNorm, RoPE, SwiGLU MLP, GQA/MQA attention
through an injected `AttentionBackend`, elementwise ops through injected `LayerOps`) and the map
from Hugging Face checkpoint tensor names to tokenmill's parameters and their shards. Every
projection (and an untied lm_head) is a `layers.linear` layer whose `LinearMethod` the injected
`QuantConfig` names for its prefix (quant/config.py; default: unquantized). The forward takes a
flat batch of several sequences' tokens and a paged KV cache per layer; all attention metadata
comes in as an argument. The residual stream is carried beside the hidden states: each layer's
residual add happens inside the next RMSNorm (`RMSNorm.add`), one fused op where the ops allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tokenmill.kernels.cpu_build import NATIVE_DTYPES
from tokenmill.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from tokenmill.layers.fused_decode import EMBED_DENSE, EMBED_INT4_HEAD, EMBED_INT8_HEAD, FusedDecode, GreedyTail
from tokenmill.layers.linear import Linear, LinearBase, MergedLinear, weight_loader_of
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import LayerOps, TorchOps
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.gguf_method import GGUFEmbedding, held_matrices
from tokenmill.quant.int_methods import HeadRows, QuantizedLinearMethod
from tokenmill.quant.method import ShardId, UnquantizedLinearMethod
from tokenmill.quant.quantize import Int8Weight

# tokenmill's fused projections -> the checkpoint projections stacked in them, in output order, each
# with the shard id its weight loader takes
STACKED_PROJECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", "gate"), ("up_proj", "up")),
}


# the checkpoint's projection -> (tokenmill's layer holding it, its shard there)
STACKED_IN = {source: (fused, shard) for fused, parts in STACKED_PROJECTIONS.items() for source, shard in parts}


def layer_prefix(hf_name: str) -> str:
    """The prefix of the tokenmill module a Hugging Face tensor name fills (`model.layers.0.self_attn.
    q_proj.weight` -> `layers.0.self_attn.qkv_proj`; `lm_head.weight` -> `lm_head`)."""
    module = hf_name.rpartition(".")[0].removeprefix("model.")
    parent, _, leaf = module.rpartition(".")
    if leaf in STACKED_IN:
        return f"{parent}.{STACKED_IN[leaf][0]}"
    return module


# Logits per chunk of `greedy_tokens`: 64K float32 values (256 KB, e.g. [32, 2048]) stay in L2.
GREEDY_CHUNK_VALUES = 1 << 16


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: shard `shard_id` of tokenmill parameter `param` (None: all of it)."""

    param: str
    shard_id: ShardId


def rms_norm(dim: int, eps: float, dtype: torch.dtype, ops: LayerOps) -> RMSNorm:
    return RMSNorm(dim, eps, ops).to(dtype)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        quant: QuantConfig,
        dtype: torch.dtype,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        shards = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
        h, prefix = cfg.hidden_size, f"layers.{layer}.self_attn"
        qkv = quant.method_for(f"{prefix}.qkv_proj", (sum(shards.values()), h))
        self.qkv_proj = MergedLinear(h, shards, bias=cfg.qkv_bias, linear_method=qkv, dtype=dtype)
        o = quant.method_for(f"{prefix}.o_proj", (h, cfg.q_size))
        self.o_proj = Linear(cfg.q_size, h, bias=cfg.o_bias, linear_method=o, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops)
            self.k_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: object,  # the step's rotary inputs, from LayerOps.rotary_inputs
        cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        # q and k heads side by side: one rotation for both
        q, k = self.ops.rotate(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.intermediate_size = inter
        shards = {"gate": inter, "up": inter}
        gate_up = quant.method_for(f"layers.{layer}.mlp.gate_up_proj", (2 * inter, h))
        self.gate_up_proj = MergedLinear(h, shards, bias=cfg.mlp_bias, linear_method=gate_up, dtype=dtype)
        down = quant.method_for(f"layers.{layer}.mlp.down_proj", (h, inter))
        self.down_proj = Linear(inter, h, bias=cfg.mlp_bias, linear_method=down, dtype=dtype)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        quant: QuantConfig,
        dtype: torch.dtype,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(cfg, layer, backend, quant, dtype, ops)
        self.post_attention_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = MLP(cfg, layer, quant, dtype, ops)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before x is added (None: layer 0)
        rope: object,
        cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, the residual stream before it
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, rope, cache, metadata), residual)
        return self.mlp(h), residual


@dataclass(frozen=True)
class _TableAsLayer:
    """A tied embedding table where a linear method asks a layer for its weight (its fused kind)."""

    weight: torch.Tensor


class LlamaForCausalLM(nn.Module):
    """Token ids of a flat batch -> hidden states; hidden states -> float32 logits.

    Parameters are created uninitialized (the loader fills them) in `dtype`, on the ambient device
    (build it under `with torch.device(...)`); each projection's and the lm_head's weights are held
    and applied by the method `quant` names for it (None: unquantized)."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        *,
        quant: QuantConfig | None = None,
        dtype: torch.dtype = torch.float32,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype  # of the weights that are not quantized, and of the activations
        quant = quant or QuantConfig.uniform()
        # products with dense weights outside a layer (a tied head, slices of the head)
        self.dense = quant.dense
        # the decoder layers as one native call a step where it applies (set by the worker; None: the modules)
        self.fused_decode: FusedDecode | None = None
        self.ops = ops = ops or TorchOps()
        # the table, or (tied and quantized, once loaded: `finish_loading`) rows read from the quantized head,
        # or (a GGUF table of a block type) the file's blocks, each looked-up row dequantized
        blocks = quant.embedding_blocks(cfg.tie_word_embeddings)
        if blocks is not None:
            self.embed_tokens: nn.Module = GGUFEmbedding(cfg.vocab_size, cfg.hidden_size, blocks, dtype)
        else:
            table = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)  # uninitialized: the loader fills it
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, quant, dtype, ops) for i in range(cfg.num_layers))
        self.norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        # a tied output projection is the embedding table itself, but for a quantized method: then the
        # head is a layer of its own, filled from the table once loaded (`fill_tied_head`), so its
        # products read the quantized bytes (a fifth of a step's for SmolLM2); once quantized, lookups
        # read its rows and the table goes (`finish_loading`)
        # (the output projection's method may be its own, e.g. int8 under int4 layers)
        head = quant.method_for("lm_head", (cfg.vocab_size, cfg.hidden_size))
        self.head_from_table = cfg.tie_word_embeddings and isinstance(head, UnquantizedLinearMethod)
        if not self.head_from_table:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, linear_method=head, dtype=dtype)

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
        rope = self.ops.rotary_inputs(self.rotary, positions, x.dtype)
        residual = None
        fused = self.fused_decode
        kinds = fused.plan(x, metadata) if fused is not None else None  # it exists only for a model with layers
        if fused is not None and kinds is not None:  # one native call for every layer
            x, residual = fused(x, rope, kv_caches, metadata, kinds)  # type: ignore[arg-type]
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, rope, cache, metadata)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add(x, residual)[0]

    def quantized_layers(self) -> list[tuple[str, LinearBase]]:
        """(name, layer) of every linear layer a quantized method holds, in module order."""
        return [
            (name, module)
            for name, module in self.named_modules()
            if isinstance(module, LinearBase) and isinstance(module.linear_method, QuantizedLinearMethod)
        ]

    def quantized_methods(self) -> list[QuantizedLinearMethod]:
        """The quantized methods the linear layers use (the projections', then a head's own), each once."""
        methods: list[QuantizedLinearMethod] = []
        for _, layer in self.quantized_layers():
            method = cast(QuantizedLinearMethod, layer.linear_method)
            if all(method is not m for m in methods):
                methods.append(method)
        return methods

    def weight_bytes(self) -> int:
        """Bytes of every weight as held: parameters (the embedding table once), quantized layers, GGUF blocks."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        blocks = sum(m.nbytes for m in held_matrices(self.modules()))
        return params + blocks + sum(layer.quantized.nbytes for _, layer in self.quantized_layers())  # type: ignore[attr-defined]

    def dense_weight_bytes(self) -> int:
        """Bytes the weights would take unquantized, in the model's dtype (a tied head once: the table)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        tied = self.config.tie_word_embeddings
        params += sum(m.shape[0] * m.shape[1] * element for m in held_matrices(self.modules()))
        return params + sum(
            layer.output_size * layer.input_size * element
            for name, layer in self.quantized_layers()
            if not (tied and name == "lm_head")
        )

    def finish_loading(self) -> None:
        """After the layers are quantized: a tied table whose head is a quantized layer of its own is
        dropped, its lookups reading the head's rows (int8: a byte a weight instead of the dtype's)."""
        if isinstance(self.embed_tokens, GGUFEmbedding):  # (a tied head of its blocks shares them)
            tied_head = self.config.tie_word_embeddings and not self.head_from_table
            self.embed_tokens.finish_loading(self.lm_head if tied_head else None)
            return
        quantized_head = not self.head_from_table and isinstance(self.lm_head.linear_method, QuantizedLinearMethod)
        if self.config.tie_word_embeddings and quantized_head:  # (another method's head keeps the table)
            self.embed_tokens = HeadRows(self.lm_head, self.dtype)

    def fill_tied_head(self) -> None:
        """Copy the embedding table into a tied head that is a layer of its own (before it is quantized)."""
        if self.config.tie_word_embeddings and not self.head_from_table:
            weight = cast(nn.Parameter, self.lm_head.weight)
            table = self.embed_tokens
            loaded = table.matrix if isinstance(table, GGUFEmbedding) else cast(torch.Tensor, table.weight).data
            weight_loader_of(weight)(weight, cast(torch.Tensor, loaded), None)  # (a GGUF table: its blocks, shared)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        if self.head_from_table:
            return self.dense.product(hidden, cast(torch.Tensor, self.embed_tokens.weight)).float()
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def greedy_run(
        self,
        ids: torch.Tensor,  # [B] int64: each sequence's next token
        starts: torch.Tensor,  # [B] int64: its position
        kv_caches: list[KVCache],
        block_tables: torch.Tensor,  # [B, W] int32, covering starts + steps tokens
        block_size: int,
        steps: int,
    ) -> torch.Tensor | None:  # [B, steps] int64, -1 where a logit was NaN
        """`steps` greedy decode steps of B sequences in one native call (`FusedDecode.run`), each step
        computed as `forward`, `compute_logits` and an argmax compute it; None where that call does not
        apply (no fused layers at B rows, an embedding that is neither a dense table, GGUF blocks (a file's
        table, a tied head's) nor a tied head in tokenmill's int8 / int4 format, in a native dtype; a head
        the fused layers do not chain): the caller steps through `forward` then."""
        fused, rows = self.fused_decode, ids.shape[0]
        kinds = fused.kinds(rows) if fused is not None else None
        tail = self._greedy_tail(rows) if kinds is not None else None
        if fused is None or kinds is None or tail is None:
            return None
        return fused.run(ids, starts, tail, kv_caches, block_tables, block_size, steps, kinds)

    def _greedy_tail(self, rows: int) -> GreedyTail | None:
        """The embedding, final norm, head and rotary tables as `FusedDecode.run` takes them (None: a part
        the native call does not take)."""
        embed = self.embed_tokens
        if isinstance(embed, nn.Embedding):
            table, embed_type = embed.weight, EMBED_DENSE
        elif isinstance(embed, HeadRows) and (held := embed.int_weights()) is not None and embed.dtype in NATIVE_DTYPES:
            # (the head's own rows, dequantized in the call)
            table, embed_type = (
                (held.q, EMBED_INT8_HEAD) if isinstance(held, Int8Weight) else (held.packed, EMBED_INT4_HEAD)
            )
        elif (
            isinstance(embed, GGUFEmbedding | HeadRows)  # (a file's table, or a tied head's kept in blocks)
            and (blocks := embed.blocks()) is not None
            and embed.dtype in NATIVE_DTYPES
        ):
            table, embed_type = blocks.data, blocks.type_number  # (the step's rows dequantized in the call)
        else:
            return None
        if self.head_from_table and embed_type == EMBED_DENSE:  # (a tied table: the dense product, as compute_logits)
            method, layer = self.dense, cast(LinearBase, _TableAsLayer(table))
            head, bias, vocab = (table, None, None, table.shape[1]), None, table.shape[0]
        elif not self.head_from_table:
            method, layer = self.lm_head.linear_method, self.lm_head
            head, bias, vocab = method.fused_tensors(layer), self.lm_head.bias, self.lm_head.output_size
        else:
            return None
        kind = method.fused_kind(layer, rows) if method.fusable(layer) else None
        if kind is None:
            return None
        rope = (self.rotary.cos, self.rotary.sin)
        return GreedyTail(table, self.norm.weight, head, bias, kind, vocab, *rope, embed_type=embed_type)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N] int64
        """Each row's argmax token without materializing [N, vocab] logits: the output projection in
        vocabulary chunks of GREEDY_CHUNK_VALUES / N rows, each chunk's maximum taken while its logits
        are in cache (on CPU that beats one product and an argmax over its spilled output at 32 rows;
        a single row's logits fit in one chunk). Ties go to the first index, as argmax. None when the
        head is not one dense matrix (a quantized lm_head): the caller computes logits then."""
        weight = self.greedy_head_weight()
        if weight is None:
            return None
        best_values: torch.Tensor | None = None
        best_ids = torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device)
        chunk = max(256, GREEDY_CHUNK_VALUES // max(1, hidden.shape[0]))
        for start in range(0, weight.shape[0], chunk):
            logits = self.dense.product(hidden, weight[start : start + chunk], shape=(weight.shape[0], weight.shape[1]))
            values, ids = logits.max(dim=-1)  # [N], [N]
            if best_values is None:
                best_values, best_ids = values, ids
            else:
                better = values > best_values  # strict: an equal later value keeps the earlier index
                best_values = torch.where(better, values, best_values)
                best_ids = torch.where(better, ids + start, best_ids)
        return best_ids

    def greedy_head_weight(self) -> torch.Tensor | None:
        """The one dense [vocab, hidden] matrix `greedy_tokens` reads, None where the head is not one."""
        if self.head_from_table:
            return cast(torch.Tensor, self.embed_tokens.weight)
        if isinstance(self.lm_head.linear_method, UnquantizedLinearMethod) and self.lm_head.bias is None:
            return cast(torch.Tensor, self.lm_head.weight)
        return None

    def tied_head(self) -> torch.Tensor | None:
        """The embedding table when it doubles as the output projection (not a layer's weight)."""
        return cast(torch.Tensor, self.embed_tokens.weight) if self.head_from_table else None

    def checkpoint_map(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> the parameter (and shard of it) it fills. Derived from the
        parameters the model has, so a LinearMethod's own parameters (named after the checkpoint's
        suffixes) are mapped too; a tied lm_head has none, and so no entry."""
        targets: dict[str, WeightTarget] = {}
        for name, _ in self.named_parameters():
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue  # filled from the table (`fill_tied_head`)
            prefix = "" if name.startswith("lm_head.") else "model."
            module, _, suffix = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf in STACKED_PROJECTIONS:
                for source, shard_id in STACKED_PROJECTIONS[leaf]:
                    targets[f"{prefix}{parent}.{source}.{suffix}"] = WeightTarget(name, shard_id)
            else:
                targets[prefix + name] = WeightTarget(name, None)
        return targets
