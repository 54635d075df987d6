"""Several decode steps in a row for a batch of greedy decodes, inside one engine step.

With a small model a decode step's forward takes a few milliseconds, and what the engine does around
it (scheduling, building the step's inputs, the outputs' bookkeeping, detokenizing: Python) is a
tenth of that or more. Where the scheduler grants it (`ScheduledChunk.num_steps`: greedy decodes that
want no log-probabilities or structure, no request waiting to be admitted, the slots reserved), the
runner runs the model up to that many times in a row, each forward's argmax token the next one's
input, and hands every token back at once: the engine's work then comes once a run, not once a token.
Where the model offers it (`greedy_run`: the fused CPU layers, an embedding table dense, in GGUF
blocks or read from a tied quantized head), the whole run is one native call; otherwise the runner
calls the model's forward and the argmax step by step.

A run is kept under RUN_SECONDS, judged by the forwards timed before at the same batch size (a step
that was never timed runs once), so a request that arrives meanwhile waits no longer than that for its
prompt to start, and a model whose forward alone takes longer runs one step at a time as before. The
tokens are those single steps would pick (the same forward, the same argmax); tokens past a stop are
dropped by the scheduler, which sees them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from tokenmill.layers.attention import AttentionBackend, KVCache
from tokenmill.outputs import ScheduledChunk

# the longest run of forwards one engine step makes (seconds): what a newly arrived request may wait
RUN_SECONDS = 0.02

Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]  # (ids, positions, metadata) -> hidden
# (ids [B], starts [B], block tables [B, W] int32, steps) -> tokens [B, steps], or None where it does not apply
Native = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor | None]


class MultiStepDecode:
    """How many forwards in a row a decode batch may take, from the forwards timed at its size; and the run."""

    def __init__(self, run_seconds: float = RUN_SECONDS) -> None:
        self.run_seconds = run_seconds
        self._seconds: dict[int, float] = {}  # batch size -> the last forward's seconds at it

    def steps(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Forwards in a row for this batch of decodes: what every chunk was granted, within the run's time."""
        granted = min((c.num_steps for c in chunks), default=1)
        seconds = self._seconds.get(len(chunks))
        if granted < 2 or seconds is None:
            return 1
        return max(1, min(granted, int(self.run_seconds / max(seconds, 1e-6))))

    def observe(self, batch: int, seconds: float) -> None:
        """One forward of a `batch`-decode step took `seconds` (the runner's timing, logits included)."""
        self._seconds[batch] = seconds

    def run(
        self,
        forward: Forward,
        pick: Callable[[torch.Tensor], torch.Tensor],
        chunks: Sequence[ScheduledChunk],
        tables: list[list[int]],
        steps: int,
        metadata: Callable[[list[int], list[int], list[list[int]]], object],
        device: torch.device,
        native: Native | None = None,
        block_size: int = 16,
    ) -> list[list[int]]:
        """`steps` forwards of the batch, each chunk's one token first, then each forward's pick; returns
        each chunk's tokens [B][steps]. `native`, where given and it applies: the whole run in one call
        (the model's `greedy_run`) over the block tables padded to a rectangle; otherwise step by step:
        `forward` (ids [B], positions [B], metadata) -> hidden [B, hidden], `pick`: hidden -> tokens [B]
        int64 (NaN rows negative), `metadata`: the backend's (query lens, sequence lens, block tables)."""
        batch = len(chunks)
        starts = [c.start_position for c in chunks]
        ids = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64, device=device)  # [B]
        if native is not None:
            width = max(-(-(p + steps) // block_size) for p in starts)  # blocks the longest reaches
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            at = torch.tensor(starts, dtype=torch.int64, device=device)
            out = native(ids, at, torch.tensor(padded, dtype=torch.int32, device=device), steps)
            if out is not None:
                return cast(list[list[int]], out.tolist())
        # [steps, B]: every forward's positions, made at once
        positions = torch.tensor([[p + s for p in starts] for s in range(steps)], dtype=torch.int64, device=device)
        picked: list[torch.Tensor] = []
        ones = [1] * batch
        for s in range(steps):
            md = metadata(ones, [p + s + 1 for p in starts], tables)
            tokens = pick(forward(ids, positions[s], md))  # [B]
            picked.append(tokens)
            ids = tokens.clamp(min=0)  # (a NaN row's request fails: its next input may be any token)
        return cast(list[list[int]], torch.stack(picked, dim=1).tolist())  # [B, steps]


def metadata_builder(
    backend: AttentionBackend, block_size: int, device: torch.device
) -> Callable[[list[int], list[int], list[list[int]]], object]:
    """The backend's metadata for (query lens, sequence lens, block tables), as `run` asks for it."""
    return lambda q, s, t: backend.build_metadata(q, s, t, block_size, device)


def model_forward(model: torch.nn.Module, caches: list[KVCache]) -> Forward:
    """The model's forward over its caches, as `run` calls it."""
    return lambda ids, positions, md: model(ids, positions, caches, md)
