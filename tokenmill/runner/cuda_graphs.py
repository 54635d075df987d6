"""DecodeGraphs: decode-only steps replayed from CUDA graphs captured at padded batch sizes.

On a GPU a decode step of a small batch is bound by its launches (about ten kernels a layer, each
a few microseconds of CPU time) more than by its work; a CUDA graph replays them all in one launch.
A graph is captured at start for each padded batch size (1, 2, 4, 8, then every 8 up to
`max_num_seqs`), over static buffers: token ids [rows], positions [rows], the backend's metadata at
fixed shapes (`padded_metadata`: the rows past the real ones write their K/V into a scratch block
no sequence owns; the block tables' buffer as wide as `max_model_len`, a step copying in only the
columns its longest sequence needs), and the hidden states it leaves [rows, hidden]. A step of B
decodes copies its inputs into the buffers of the smallest size >= B, replays that graph and reads
its B rows back. Steps with prompt chunks or drafts run eagerly.

The graphs share one memory pool and are captured largest first (the smaller ones reuse its
blocks). A backend that can be captured implements `PaddedMetadata` (the Triton one).

With `capture=False` (every device but CUDA) the same buffers run eagerly: the tests check the
padding, the scratch block and the buffer copies that way on the CPU, under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.models.llama import LlamaForCausalLM


@runtime_checkable
class PaddedMetadata(Protocol):
    """A backend whose decode metadata can be built at fixed shapes (its tensors then copied into a
    graph's static ones)."""

    def padded_metadata(
        self,
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        rows: int,
        width: int,
        scratch_block: int,
    ) -> Any: ...


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


@dataclasses.dataclass
class _Graph:
    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    metadata: Any  # the backend's metadata for `rows` decodes; its tensors are refilled each step
    hidden: torch.Tensor  # [rows, hidden]: what the replay leaves
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly over the buffers (no CUDA)


class DecodeGraphs:
    """`build_metadata` fills the static buffers of a step's padded size and returns its metadata (the
    runner builds the step's inputs through it, in place of the backend); `forward` then replays."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        backend: PaddedMetadata,
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        sizes: list[int],
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.sizes = sorted(sizes)
        self.device = model.norm.weight.device
        self._graphs: dict[int, _Graph] = {}
        self._current: _Graph | None = None
        pool = torch.cuda.graph_pool_handle() if capture else None
        for rows in reversed(self.sizes):  # the largest first: the others fit in its pool
            self._graphs[rows] = self._capture(rows, pool) if capture else self._buffers(rows)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def covers(self, query_lens: list[int]) -> bool:
        """Whether a step of these query lengths replays a graph: decodes only, few enough."""
        return 0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)

    def padded_size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        if not self.covers(query_lens) or block_size != self.block_size:
            raise ValueError(f"DecodeGraphs: a step of query lengths {query_lens} is not a graphed decode step")
        g = self._graphs[self.padded_size(len(query_lens))]
        rows = g.input_ids.shape[0]
        step = self.backend.padded_metadata(
            seq_lens, block_tables, block_size, self.device, rows, self.width, self.scratch_block
        )
        for field in dataclasses.fields(step):
            value = getattr(step, field.name)
            if isinstance(value, torch.Tensor):  # into the buffer's leading part (a narrower block table)
                getattr(g.metadata, field.name)[tuple(slice(0, n) for n in value.shape)].copy_(value)
            elif value != getattr(g.metadata, field.name):
                raise ValueError(f"DecodeGraphs: metadata field {field.name} changed shape ({value})")
        self._current = g
        return g.metadata  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [B] of the step whose metadata was built last -> hidden [B, hidden]
        (a view of the graph's buffer: read it before the next step)."""
        g = self._current
        if g is None:
            raise ValueError("DecodeGraphs.forward: build_metadata first")
        batch = input_ids.shape[0]
        g.input_ids[:batch].copy_(input_ids)
        g.input_ids[batch:].zero_()
        g.positions[:batch].copy_(positions)
        g.positions[batch:].zero_()
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hidden.copy_(self._run(g))
        self._current = None
        return g.hidden[:batch]

    def _buffers(self, rows: int) -> _Graph:
        metadata = self.backend.padded_metadata(  # a context of `width` blocks: the buffers at full width
            [self.width * self.block_size], [[self.scratch_block] * self.width], self.block_size, self.device,
            rows, self.width, self.scratch_block,
        )  # fmt: skip
        with torch.device(self.device):
            ids, positions = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
            hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype)
        return _Graph(ids, positions, metadata, hidden, None)

    def _run(self, g: _Graph) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(g.input_ids, g.positions, self.kv_caches, g.metadata)

    def _capture(self, rows: int, pool: Any) -> _Graph:
        """The graph of `rows` padding decodes (they touch only the scratch block): run twice on a side
        stream first (kernels compile, allocations settle), then captured."""
        g = self._buffers(rows)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(g)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._run(g)
        torch.cuda.synchronize(self.device)
        return _Graph(g.input_ids, g.positions, g.metadata, hidden, graph)
