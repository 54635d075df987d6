"""InputBatch: the runner's persistent batch — one row per request it knows, kept between steps.

A request gets a row the first time the scheduler sends it and keeps it until the scheduler reports
it finished; its sampling parameters sit in preallocated per-row tensors (written once, on join),
and each logits processor keeps its own per-row state beside them. When a request leaves, the last
row moves into its place, so rows stay dense. Each step reads what it needs by row index: no
[B, V] tensor is rebuilt from Python lists. Capacity grows (doubling) when more requests are known
than it holds (preempted requests keep their rows).

Pure bookkeeping for the runner; never sees a scheduler `Request`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.errors import describe
from tokenmill.layers.logits_processor import LogitsProcessor, PenaltiesProcessor
from tokenmill.layers.sampler import SamplingMetadata, host_fields
from tokenmill.layers.token_constraints import (
    AllowedTokensProcessor,
    BadWordsProcessor,
    LogitBiasProcessor,
    MinTokensProcessor,
)
from tokenmill.outputs import NewRequestData
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.processor import GrammarProcessor


@dataclass
class RowState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    next_prompt_logprob: int = 1  # the next prompt position whose logprob is owed
    block_table: list[int] = field(default_factory=list)  # its KV blocks, as the scheduler's chunks said


class InputBatch:
    def __init__(
        self,
        capacity: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        """`grammar`: gives the GrammarCompiler structured-output requests need (None: refused here)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.rows: list[RowState] = []  # row i's request
        self.row_of: dict[str, int] = {}
        self.capacity = max(1, capacity)
        self.temperature = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)  # [C]
        self.top_k = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)  # [C]
        self.top_p = torch.ones(self.capacity, dtype=torch.float32, device=self.device)  # [C]
        self.min_p = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)  # [C]
        self.penalties = PenaltiesProcessor(self.capacity, vocab_size, self.device)
        # in vLLM's order: the grammar's mask, which tokens may come at all, then biases, then the penalties
        self.grammar = GrammarProcessor(grammar, vocab_size) if grammar is not None else None
        self.processors: list[LogitsProcessor] = [self.grammar] if self.grammar is not None else []
        self.processors += [
            AllowedTokensProcessor(),
            BadWordsProcessor(),
            MinTokensProcessor(),
            LogitBiasProcessor(),
            self.penalties,
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def state(self, request_id: str) -> RowState:
        return self.rows[self.row_of[request_id]]

    # -- rows joining, leaving, moving -----------------------------------------------------------

    def add(self, new: NewRequestData) -> int:
        if new.request_id in self.row_of:
            raise ValueError(f"request_id: {new.request_id!r} already has a row")
        if len(self.rows) == self.capacity:
            self._grow(2 * self.capacity)
        row = len(self.rows)
        p = new.sampling_params
        self.rows.append(RowState(new.request_id, new.prompt_token_ids, p, new.seed))
        self.row_of[new.request_id] = row
        self.temperature[row] = p.temperature
        self.top_k[row] = self.vocab_size if p.top_k is None else min(p.top_k, self.vocab_size)
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        for processor in self.processors:
            processor.add_row(row, p, new.prompt_token_ids, new.eos_token_ids)
        if new.output_token_ids:  # tokens another engine generated: penalties and positions count them
            failed = self.append_tokens([new.request_id] * len(new.output_token_ids), new.output_token_ids)
            if failed:
                raise RuntimeError(failed[new.request_id])
        return row

    def remove(self, request_id: str) -> None:
        """Drop a request's row; the last row moves into the hole. Unknown ids are ignored."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = len(self.rows) - 1
        for processor in self.processors:
            processor.remove_row(row)
        if row != last:
            moved = self.rows[last]
            self.rows[row] = moved
            self.row_of[moved.request_id] = row
            for t in (self.temperature, self.top_k, self.top_p, self.min_p):
                t[row] = t[last]
            for processor in self.processors:
                processor.move_row(last, row)
        self.rows.pop()

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.temperature = torch.cat([self.temperature, self.temperature.new_zeros(extra)])
        self.top_k = torch.cat([self.top_k, self.top_k.new_zeros(extra)])
        self.top_p = torch.cat([self.top_p, self.top_p.new_ones(extra)])
        self.min_p = torch.cat([self.min_p, self.min_p.new_zeros(extra)])
        self.penalties.grow(capacity)
        self.capacity = capacity

    # -- a step ----------------------------------------------------------------------------------

    def append_tokens(self, request_ids: list[str], tokens: list[int]) -> dict[str, str]:
        """Each request sampled its token. Only active processors hear of it: an inactive one has no
        rows, so it has nothing to record. A processor that fails on a request's token fails that
        request alone: {request id: why} (the others' tokens are recorded)."""
        active = [p for p in self.processors if p.active]
        failed: dict[str, str] = {}
        for request_id, token in zip(request_ids, tokens, strict=True):
            row = self.row_of[request_id]
            self.rows[row].output_token_ids.append(token)
            for processor in active:
                try:
                    processor.append_token(row, token)
                except Exception as e:
                    failed[request_id] = describe(f"{type(processor).__name__} failed on token {token}", e)
        return failed

    def sampling_metadata(self, request_ids: list[str], counts: list[int] | None = None) -> SamplingMetadata:
        """The metadata of the logits rows of these requests, in this order: one position each, or
        counts[i] consecutive output positions for request i (a speculative step's verification rows)."""
        rows: list[int] = []
        positions: list[int] = []
        for request_id, count in zip(request_ids, counts or [1] * len(request_ids), strict=True):
            row = self.row_of[request_id]
            first = len(self.rows[row].output_token_ids)
            rows += [row] * count
            positions += range(first, first + count)
        states = [self.rows[r] for r in rows]
        requested = [s.params.logprobs for s in states if s.params.logprobs is not None]
        if rows == list(range(len(rows))):  # the usual decode step: rows in order, so views, no copies
            n = len(rows)
            index = torch.arange(n, device=self.device)
            temperature, top_k, top_p, min_p = self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n]
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            temperature, top_k = self.temperature.index_select(0, index), self.top_k.index_select(0, index)
            top_p, min_p = self.top_p.index_select(0, index), self.min_p.index_select(0, index)
        return SamplingMetadata(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=[s.seed for s in states],
            output_positions=positions,
            max_num_logprobs=max(requested, default=0),
            logprobs_requested=bool(requested),
            processors=[p for p in self.processors if p.active],
            batch_rows=index,
            batch_row_ids=rows,
            **host_fields([s.params for s in states], self.vocab_size),
        )
