"""The `cpu` attention backend: a native kernel that attends over the paged KV cache in place.

Every sequence goes to `torch.ops.tokenmill_cpu.paged_attention` (kernels/csrc/attention.cpp): one
pass per (sequence, KV head, slice of its queries) over its own blocks, no gather into a contiguous
tensor, no padding to the longest context, no conversion of the whole context to float32; a prompt
chunk's slices skip the keys after their last query (the causal half torch's SDPA computes and masks
when a chunk has keys cached before it). Where the CPU kind's rule says so (`prompt_attention` in
kernels/defaults.py: AMX, whose bfloat16 tiles torch's SDPA may use, until measured there), prompt
chunks longer than `MAX_KERNEL_QUERY` go through the reference backend's SDPA path
(`attend_chunks`) instead. The new tokens' K/V are written by one native call per layer, before
anything is attended: so with an int8 cache every query, a prompt's first chunk's included, attends
over the cache's dequantized keys and values (SDPA's path and the reference attend a chunk with
nothing cached before it over its fresh ones).

Cache layout, per layer: K and V of [num_blocks, num_kv_heads, block_size * head_dim], one
contiguous chunk per (block, KV head); K's chunk is [head_dim, block_size] (keys side by side: a
query's scores against a block are vector FMAs), V's is [block_size, head_dim] (see attention.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import torch

from tokenmill.kernels.cpu_build import CpuKernels, cpu_flags
from tokenmill.kernels.defaults import ANY, PROMPT, CpuKind, default_choice
from tokenmill.layers.attention import KVCache, allocate_kv_cache, check_batch
from tokenmill.layers.backends.torch_ref import PrefillSequence, attend_chunks

# Where prompt chunks go to SDPA (`prompt_attention` = `sdpa`): sequences with more new tokens than this.
MAX_KERNEL_QUERY = 16
PROMPT_ATTENTION = ("native", "sdpa")
PROBE_BLOCK = 16  # the block size `prompt_candidates` times with


@dataclass
class CpuMetadata:
    num_actual_tokens: int  # tokens [0, n) of the batch are real; the rest is padding
    block_size: int
    slot_mapping: torch.Tensor  # [n] int64: block_id * block_size + offset of each real token
    # The sequences the kernel attends (int32, one entry each):
    block_tables: torch.Tensor  # [S, max blocks], shorter tables padded with block 0 (never read)
    seq_lens: torch.Tensor  # [S]
    query_starts: torch.Tensor  # [S]: first row of each sequence's queries in the flat batch
    query_lens: torch.Tensor  # [S]
    prefills: list[PrefillSequence]  # (`prompt_attention` = `sdpa`) longer prompt chunks: SDPA, one call each


class CpuPagedBackend:
    name = "cpu"

    def __init__(self, kernels: CpuKernels, prompt_attention: str | None = None) -> None:
        """`prompt_attention`: `native` or `sdpa` for prompt chunks (default: the CPU kind's rule)."""
        self.kernels = kernels
        self.ops = kernels.ops
        kind = CpuKind.from_flags(cpu_flags())
        self.use_for_prompts(
            prompt_attention or default_choice("prompt_attention", PROMPT, ANY, kind, PROMPT_ATTENTION)
        )

    def use_for_prompts(self, name: str) -> None:
        """Prompt chunks longer than MAX_KERNEL_QUERY through `name`: `native` (the paged kernel) or `sdpa`."""
        if name not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, not {name!r}")
        self.prompt_attention = name
        self.longest_kernel_query = MAX_KERNEL_QUERY if name == "sdpa" else None

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size * head_dim)

    def kv_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size)  # beside each (block, KV head) chunk, a scale a token

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> CpuMetadata:
        check_batch(query_lens, seq_lens, block_tables, block_size)
        slots: list[int] = []
        kernel: list[int] = []
        prefills: list[PrefillSequence] = []
        start = 0
        for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s - q, s))
            if self.longest_kernel_query is None or q <= self.longest_kernel_query:
                kernel.append(b)
            else:
                blocks = torch.tensor(table[: -(-s // block_size)], dtype=torch.int64, device=device)
                prefills.append(PrefillSequence(start, q, s, blocks))
            start += q
        starts = [0]
        for q in query_lens[:-1]:
            starts.append(starts[-1] + q)
        width = max((-(-seq_lens[b] // block_size) for b in kernel), default=0)
        flat: list[int] = []
        for b in kernel:
            used = block_tables[b][: -(-seq_lens[b] // block_size)]
            flat.extend(used)
            flat.extend([0] * (width - len(used)))

        # the four int32 fields made as one tensor (one op, not four), then split into views
        num = len(kernel)
        ints = flat + [seq_lens[b] for b in kernel] + [starts[b] for b in kernel] + [query_lens[b] for b in kernel]
        tables, lens, first_rows, counts = torch.tensor(ints, dtype=torch.int32, device=device).split(
            [num * width, num, num, num]
        )
        return CpuMetadata(
            num_actual_tokens=start,
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=tables.view(num, width),
            seq_lens=lens,
            query_starts=first_rows,
            query_lens=counts,
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k: torch.Tensor,  # [T, kv_heads, D]
        v: torch.Tensor,
        cache: KVCache,
        metadata: CpuMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, D]
        md = metadata
        n = md.num_actual_tokens
        # the real tokens only
        self.ops.write_kv(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, md.slot_mapping, md.block_size)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if out.shape[0] > n:
            out[n:] = 0  # padding rows
        if md.seq_lens.numel():
            self.ops.paged_attention(
                out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, md.block_tables, md.seq_lens,
                md.query_starts, md.query_lens, md.block_size, scale, sliding_window,
            )  # fmt: skip
        gather = partial(self._gather, cache, block_size=md.block_size, kv_heads=k.shape[1], dim=k.shape[2])
        attend_chunks(out, q, k, v, md.prefills, gather, scale, sliding_window)
        return out

    @staticmethod
    def _gather(
        cache: KVCache, seq: PrefillSequence, block_size: int, kv_heads: int, dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values [seq_len, kv_heads, D]
        blocks = seq.block_table.numel()
        k = cache.k.index_select(0, seq.block_table).view(blocks, kv_heads, dim, block_size).permute(0, 3, 1, 2)
        v = cache.v.index_select(0, seq.block_table).view(blocks, kv_heads, block_size, dim).transpose(1, 2)
        if cache.k_scale is not None and cache.v_scale is not None:  # int8: scaled per token [blocks, bs, kv_heads]
            k = k.float() * cache.k_scale.index_select(0, seq.block_table).transpose(1, 2)[..., None]
            v = v.float() * cache.v_scale.index_select(0, seq.block_table).transpose(1, 2)[..., None]
        return k.reshape(-1, kv_heads, dim)[: seq.seq_len], v.reshape(-1, kv_heads, dim)[: seq.seq_len]


def prompt_candidates(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, chunk: int
) -> dict[str, Callable[[], object]]:
    """A long prompt's second chunk (`chunk` new tokens after as many cached: the chunk that pays for
    the keys before it) through each `prompt_attention` path, for the autotuner. The inputs are made
    on the first call (a start-up that reads the choice back makes none)."""
    blocks = -(-2 * chunk // PROBE_BLOCK)

    @cache
    def inputs() -> tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        native = CpuPagedBackend(kernels, "native")
        kv_cache = allocate_kv_cache(native, 1, blocks, PROBE_BLOCK, kv_heads, dim, dtype)[0]
        q = torch.randn(chunk, heads, dim, generator=gen).to(dtype)
        k, v = torch.randn(2, chunk, kv_heads, dim, generator=gen).to(dtype)
        return kv_cache, q, k, v

    def path(name: str) -> Callable[[], object]:
        backend = CpuPagedBackend(kernels, name)

        def run() -> torch.Tensor:
            kv_cache, q, k, v = inputs()
            md = backend.build_metadata([chunk], [2 * chunk], [list(range(blocks))], PROBE_BLOCK)
            return backend.forward(q, k, v, kv_cache, md, dim**-0.5, None)

        return run

    return {name: path(name) for name in PROMPT_ATTENTION}
