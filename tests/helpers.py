"""Test helpers: the logit comparison rule, the near-tie rule for comparing two runs' greedy tokens,
and a step-by-step driver over a paged KV cache."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.layers.attention import AttentionBackend, allocate_kv_cache
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.outputs import TokenLogprob


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within `rel` of the reference's logit scale (its max |logit|)."""
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel} x logit scale {scale:.3g}"


# Two float32 runs of the same model (other batch sizes, chunkings, or transformers) may break a
# near-tie either way: their logits differ by ~1e-5. A divergence is allowed only where the two
# tokens' log-probabilities are this close on both sides; a wrong pick (a runner-up one nat behind)
# is not a near tie.
NEAR_TIE_NATS = 1e-3


def assert_same_up_to_near_tie(
    a: Sequence[int],
    a_logprobs: Sequence[dict[int, float]],
    b: Sequence[int],
    b_logprobs: Sequence[dict[int, float]],
    tie_nats: float = NEAR_TIE_NATS,
) -> bool:
    """Greedy tokens `a` and `b` are equal, or equal up to a first divergence at a near tie: there
    both tokens are within NEAR_TIE_NATS of each other in each side's distribution (`*_logprobs[j]`:
    token -> logprob at output position j, covering at least the top few tokens); the comparison
    stops there, since each side then continues from another context. Returns True when equal.
    `tie_nats`: a wider tie for runs that differ by more than float noise (an int8 KV cache)."""
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    for j, (x, y) in enumerate(zip(a, b, strict=True)):
        if x == y:
            continue
        for side, lp in (("first", a_logprobs[j]), ("second", b_logprobs[j])):
            assert x in lp and y in lp, f"diverged at {j}: {x} vs {y}, not both among the {side} run's top tokens"
            gap = abs(lp[x] - lp[y])
            assert gap <= tie_nats, f"diverged at {j}: {x} vs {y}, {gap:.3g} nats apart in the {side} run"
        return False
    return True


def top_logprobs(logprobs: Sequence[TokenLogprob] | None) -> list[dict[int, float]]:
    """An output's per-token logprob entries -> token -> logprob at each position (top + chosen)."""
    assert logprobs is not None, "the comparison needs the outputs' logprobs"
    return [dict(entry.top) | {entry.token_id: entry.logprob} for entry in logprobs]


class PagedRunner:
    """Drives the model step by step over a paged cache, the way the engine will."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        block_order: list[int],
        backend: AttentionBackend | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.backend = backend or model.layers[0].self_attn.backend
        dtype = model.dtype
        self.caches = allocate_kv_cache(
            self.backend, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype
        )
        self.free = list(block_order)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, torch.Tensor], pad_to: int = 0) -> dict[int, torch.Tensor]:
        """Run new tokens for several sequences in one flat batch; returns their logits per sequence."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop(0))
            self.lens[seq] = end
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            ids.append(tokens)
            positions.append(torch.arange(start, end))
        input_ids, pos = torch.cat(ids), torch.cat(positions)
        n = len(input_ids)
        if pad_to > n:
            input_ids = torch.cat([input_ids, torch.zeros(pad_to - n, dtype=torch.int64)])
            pos = torch.cat([pos, torch.zeros(pad_to - n, dtype=torch.int64)])
        md = self.backend.build_metadata(query_lens, seq_lens, tables, self.block_size)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(input_ids, pos, self.caches, md))
        out, offset = {}, 0
        for seq, q in zip(chunks, query_lens, strict=True):
            out[seq] = logits[offset : offset + q]
            offset += q
        return out


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (prefix of a projection, its dense weight [N, K]) -> (its tensors by suffix, the dense weight they stand for)
Packer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized_copies(source: Path, out: Path, ref: Path, pack: Packer, quantization_config: dict) -> None:
    """`out`: the model folder `source` (one weight file or shards) with each decoder projection's
    weight replaced by the tensors `pack` makes of it and `quantization_config` in its config.json;
    `ref`: the same model holding the dense weights those tensors stand for (the reference)."""
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        weights |= load_file(str(file))
    for folder in (out, ref):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    packed, dense = {}, {}
    for name, w in weights.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS):
            packed[name] = dense[name] = w
            continue
        tensors, dense[name] = pack(prefix, w)
        dense[name] = dense[name].to(w.dtype)
        packed |= {f"{prefix}.{suffix}": t for suffix, t in tensors.items()}
    save_file(packed, str(out / "model.safetensors"))
    save_file(dense, str(ref / "model.safetensors"))
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg))
