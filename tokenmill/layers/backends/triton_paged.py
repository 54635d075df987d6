"""TritonPagedBackend: paged attention in one Triton kernel, for GPUs (and Triton's CPU interpreter).

The cache keeps the reference backend's layout, [blocks, block_size, kv_heads, head_dim] per layer
(so the torch reference reads what this one writes). One kernel serves every step: a program per
(query token, query head) walks its sequence's blocks through the block table, up to its own
position (causal) and from the window's start (sliding window), with an online softmax in float32:
decodes (one query), speculative verification (1 + k) and prompt chunks (varlen, over the cached
prefix and the chunk itself) alike; a prompt with nothing cached before it goes through torch's SDPA
instead (flash attention on a GPU) in layers without a window (`sdpa_prompts`). GQA/MQA: query head
h reads KV head h // (heads / kv_heads). New K/V are written into their slots first (one scatter).
An int8 cache is not supported here. The loop's bounds are read in the kernel, so it compiles once
per head shape, not per context length; and a decode step's metadata can be built at fixed shapes
(`padded_metadata`) for a CUDA graph to replay.

Triton is imported only when this backend is built (`pip install 'tokenmill[gpu]'`, triton 3.6.0);
nothing on the CPU path imports it. Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors: the
tests compare it there with the reference on small shapes; the device script repeats that on real
shapes and times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import KVCache, check_batch
from tokenmill.layers.backends.torch_ref import ReferenceLayout


@dataclass
class TritonMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [n] int64: block_id * block_size + offset of each real token
    token_seq: torch.Tensor  # [n] int32: each query token's sequence
    token_pos: torch.Tensor  # [n] int32: each query token's position in its sequence
    block_tables: torch.Tensor  # [B, width] int32 (padded: never read past a sequence's own blocks)
    all_rows: torch.Tensor  # [n] int32: 0 .. n-1, the kernel's rows when it attends every token
    paged_rows: torch.Tensor  # [m] int32: the rows of the tokens not in `fresh`
    # (first row, length) of each prompt with nothing cached before it (several tokens): attended by
    # SDPA (flash attention on a GPU) in layers without a sliding window, when the backend is asked to
    fresh: list[tuple[int, int]]


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention(
        q_ptr, k_cache, v_cache, out_ptr, rows, token_seq, token_pos, tables,
        scale, window,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
        GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):  # fmt: skip
        t = tl.load(rows + tl.program_id(0))  # the query token this program attends for
        h = tl.program_id(1)
        kvh = h // GROUP
        seq = tl.load(token_seq + t)
        pos = tl.load(token_pos + t)
        d = tl.arange(0, D_PAD)  # head_dim rounded up to a power of two (arange's rule), the rest masked
        in_head = d < D
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=in_head, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((D_PAD,), tl.float32)
        # the blocks from the window's first (or the sequence's) to the token's own: a while loop, whose
        # bounds Triton's interpreter can take from loaded values (its `range` cannot, with numpy 2)
        i = tl.zeros((), tl.int32)
        if HAS_WINDOW:
            i = tl.maximum(pos - window + 1, 0) // BLOCK
        while i <= pos // BLOCK:
            block = tl.load(tables + seq * stride_tb + i).to(tl.int64)  # (offsets past 2**31 in a large cache)
            key_pos = i * BLOCK + tl.arange(0, BLOCK)
            offs = block * stride_kb + tl.arange(0, BLOCK)[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            keys = tl.load(k_cache + offs, mask=in_head[None, :], other=0.0).to(tl.float32)  # [BLOCK, D_PAD]
            scores = tl.sum(keys * q[None, :], axis=1) * scale  # [BLOCK]
            visible = key_pos <= pos
            if HAS_WINDOW:
                visible = visible & (key_pos > pos - window)
            scores = tl.where(visible, scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - new_m)
            p = tl.exp(scores - new_m)
            # (slots past the token: masked, so that a stale inf or NaN there cannot make 0 x V a NaN)
            values = tl.load(v_cache + offs, mask=visible[:, None] & in_head[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
            denom = denom * alpha + tl.sum(p, axis=0)
            m = new_m
            i += 1
        out = acc / denom
        tl.store(out_ptr + t * stride_qt + h * stride_qh + d, out.to(out_ptr.dtype.element_ty), mask=in_head)

    return paged_attention


class TritonPagedBackend(ReferenceLayout):
    """`sdpa_prompts`: a prompt with nothing cached before it goes through torch's SDPA (flash attention
    on a GPU: tensor cores) in layers without a sliding window, the kernel taking the other tokens;
    False: the kernel takes every token (the device script times both)."""

    name = "triton"

    def __init__(self, sdpa_prompts: bool = True) -> None:
        import os

        self.sdpa_prompts = sdpa_prompts

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend: triton needs a CUDA device (or TRITON_INTERPRET=1, Triton's slow CPU "
                "interpreter, for tests); on a CPU use cpu or torch"
            )
        try:
            self._paged_attention = _kernel()
        except ImportError:
            raise ValueError(
                "attention_backend: triton is not installed (pip install 'tokenmill[gpu]': triton 3.6.0)"
            ) from None

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> TritonMetadata:
        check_batch(query_lens, seq_lens, block_tables, block_size)
        width = max(-(-s // block_size) for s in seq_lens)
        return self._metadata(query_lens, seq_lens, block_tables, block_size, device, sum(query_lens), width, 0)

    def padded_metadata(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        rows: int,
        width: int,
        scratch_block: int,
    ) -> TritonMetadata:
        """A decode step's metadata for a CUDA graph (runner/cuda_graphs.py): `rows` tokens (one a
        sequence; the rows past the real ones write their K/V to `scratch_block`, a block no sequence
        owns, and attend to it), block tables as wide as this step's longest (at most `width`: the graph's
        buffer, into whose leading columns they are copied; the kernel reads no column past a sequence's own)."""
        needed = max((-(-s // block_size) for s in seq_lens), default=1)
        if len(seq_lens) > rows or needed > width:
            raise ValueError(f"padded_metadata: {len(seq_lens)} sequences exceed {rows} rows x {width} blocks")
        check_batch([1] * len(seq_lens), seq_lens, block_tables, block_size)
        pad = rows - len(seq_lens)
        return self._metadata(
            [1] * rows, seq_lens + [1] * pad, block_tables + [[scratch_block]] * pad, block_size, device, rows,
            needed, scratch_block,
        )  # fmt: skip

    @staticmethod
    def _metadata(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        tokens: int,
        width: int,
        fill: int,
    ) -> TritonMetadata:
        """`tokens` query tokens over block tables `width` wide (padded with `fill`, never read)."""
        slots: list[int] = []
        seqs: list[int] = []
        positions: list[int] = []
        paged: list[int] = []
        fresh: list[tuple[int, int]] = []
        for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if q == s and q > 1:
                fresh.append((len(slots), q))
            else:
                paged.extend(range(len(slots), len(slots) + q))
            for p in range(s - q, s):
                slots.append(table[p // block_size] * block_size + p % block_size)
                seqs.append(b)
                positions.append(p)
        tables = [(t[:width] + [fill] * width)[:width] for t in block_tables]
        # one host-to-device copy for the five
        flat = torch.tensor(slots + seqs + positions + list(range(tokens)) + paged, dtype=torch.int64).to(device)
        slot_mapping, token_seq, token_pos, all_rows, paged_rows = flat.split([tokens] * 4 + [len(paged)])
        return TritonMetadata(
            num_actual_tokens=tokens,
            slot_mapping=slot_mapping,
            token_seq=token_seq.to(torch.int32),
            token_pos=token_pos.to(torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            all_rows=all_rows.to(torch.int32),
            paged_rows=paged_rows.to(torch.int32),
            fresh=fresh,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k: torch.Tensor,  # [T, kv_heads, D]
        v: torch.Tensor,
        cache: KVCache,
        metadata: TritonMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, D]
        if cache.k_scale is not None:
            raise ValueError("kv_cache_dtype: int8 is not supported by the triton attention backend")
        md = metadata
        n = md.num_actual_tokens
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = k.shape[1], cache.k.shape[1]
        cache.k.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k[:n])
        cache.v.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v[:n])
        out = torch.zeros_like(q)  # padding rows stay zero
        rows = md.all_rows
        if self.sdpa_prompts and sliding_window is None and md.fresh:
            rows = md.paged_rows
            for start, length in md.fresh:  # [1, heads, L, D] each: causal over the prompt itself
                qs, ks, vs = (x[start : start + length].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                attended = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
                )
                out[start : start + length] = attended[0].transpose(0, 1)
        if rows.numel() == 0:
            return out
        qc = q.contiguous()
        self._paged_attention[(rows.numel(), num_heads)](
            qc, cache.k, cache.v, out, rows, md.token_seq, md.token_pos, md.block_tables,
            scale, sliding_window or 0,
            qc.stride(0), qc.stride(1), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
            md.block_tables.stride(0),
            GROUP=num_heads // num_kv_heads, BLOCK=block_size, D=head_dim, D_PAD=1 << (head_dim - 1).bit_length(),
            HAS_WINDOW=sliding_window is not None,
        )  # fmt: skip
        return out
