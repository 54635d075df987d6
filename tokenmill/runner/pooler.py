"""Pooler: the runner's side of pooling requests — hidden states in, one vector per finished prompt out.

A pooling request's chunks run in the step's flat batch like any prompt's; its rows of the model's
output (the final norm's, [T, hidden]: what the output projection reads) are pooled here, chunk by
chunk, and when the chunk that reaches its last prompt token has run, its vector goes into
`StepOutput.pooled` (PoolingParams says what the vector is):

- `last`: the last prompt token's row; `cls`: position 0's row, kept from the first chunk; `mean`: the
  running float32 sum of every row and their count (a chunk starting at position 0 resets both, so a
  preempted request that starts over counts each position once; the scheduler gives such a request no
  prefix-cache hit, which would skip positions);
- then truncated to `dimensions` and L2-normalized (`normalize`), in float32;
- `score`: the logits of the last prompt token's row (one output projection for every such row of the
  step), softmax over `score_token_ids` alone.

A NaN in a vector fails its request alone. Per-request state lives here from the request's first
chunk until the runner is told it finished (or forgets it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.outputs import ScheduledChunk, StepOutput
from tokenmill.pooling_params import PoolingParams


@dataclass
class PoolState:
    params: PoolingParams
    total: torch.Tensor | None = None  # mean: [hidden] float32 sum of the rows so far
    count: int = 0  # mean: rows summed
    first: torch.Tensor | None = None  # cls: [hidden] float32, position 0's row


class Pooler:
    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """`compute_logits`: the model's output projection ([N, hidden] -> [N, vocab] float32), for scores."""
        self.compute_logits = compute_logits
        self.states: dict[str, PoolState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def add(self, request_id: str, params: PoolingParams) -> None:
        self.states[request_id] = PoolState(params)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def pool(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, result: StepOutput) -> None:
        """Fold this step's pooling chunks into their requests; the finished ones' vectors into
        `result.pooled` (a NaN one into `result.failed`). `hidden`: [T, hidden], the chunks' rows in order."""
        finished: list[tuple[str, torch.Tensor]] = []  # (request id, its last prompt row [hidden])
        offset = 0
        for c in chunks:
            n = len(c.token_ids)
            state = self.states.get(c.request_id)
            if state is not None:
                rows = hidden[offset : offset + n]  # [n, hidden]
                self._accumulate(state, c.start_position, rows)
                if c.sample:  # the chunk reached the prompt's last token
                    finished.append((c.request_id, rows[-1]))
            offset += n
        scored = [(i, row) for i, row in finished if self.states[i].params.task == "score"]
        # [S, vocab] float32: one output projection for every score row of the step
        logits = self.compute_logits(torch.stack([row for _, row in scored])) if scored else None
        score_row = {request_id: k for k, (request_id, _) in enumerate(scored)}
        for request_id, row in finished:
            state = self.states[request_id]
            if request_id in score_row:
                assert logits is not None
                vector = self._softmax(logits[score_row[request_id]], state.params)
            else:
                vector = self._embedding(state, row)
            if bool(torch.isnan(vector).any()):
                result.failed[request_id] = "the model's output for it was NaN"
            else:
                result.pooled[request_id] = vector.tolist()

    @staticmethod
    def _accumulate(state: PoolState, start: int, rows: torch.Tensor) -> None:
        params = state.params
        if params.task != "embed" or params.pooling == "last":
            return
        if start == 0:  # (again, after a preemption: every position is computed anew)
            state.total, state.count, state.first = None, 0, None
        if params.pooling == "cls":
            if start == 0:
                state.first = rows[0].to(torch.float32, copy=True)  # (not a view of a buffer reused later)
            return
        chunk_sum = rows.float().sum(dim=0)  # [hidden]
        state.total = chunk_sum if state.total is None else state.total + chunk_sum
        state.count += rows.shape[0]

    @staticmethod
    def _embedding(state: PoolState, last_row: torch.Tensor) -> torch.Tensor:
        """The finished request's embedding [dims] float32: pooled, truncated, normalized."""
        params = state.params
        if params.pooling == "last":
            vector = last_row.float()
        elif params.pooling == "cls":
            assert state.first is not None, "cls pooling without position 0's row"
            vector = state.first
        else:
            assert state.total is not None and state.count > 0, "mean pooling without rows"
            vector = state.total / state.count
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        return F.normalize(vector, dim=-1) if params.normalize else vector

    @staticmethod
    def _softmax(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Softmax over the logits [vocab] of `score_token_ids` alone: [len(score_token_ids)]."""
        ids = torch.tensor(params.score_token_ids, dtype=torch.int64, device=logits.device)
        return logits.index_select(0, ids).softmax(dim=-1)
