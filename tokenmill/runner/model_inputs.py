"""SchedulerOutput -> model inputs: flat token ids, positions, attention metadata, and which rows
of the hidden states need logits (the last token of each sampling chunk, every token of a chunk of
drafts to verify, and prompt positions whose log-probabilities were asked for)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.attention import AttentionMetadata, MetadataBuilder
from tokenmill.outputs import ScheduledChunk


@dataclass
class PromptLogprobRows:
    request_id: str
    first_row: int  # index into the logits rows
    targets: list[int]  # the prompt tokens these rows predict, in order
    first_position: int  # prompt position of the first target


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64: token rows whose hidden states need logits
    every_row: bool  # logits_rows is every token row in order (a decode-only step): no gather needed
    sample_rows: dict[str, int]  # request id -> its (first) sampling row among the R logits rows
    # request id -> the draft tokens it brought (speculative decoding): its sampling rows are then
    # 1 + len(drafts), the one after its last token and one after each draft, in order
    drafts: dict[str, list[int]]
    prompt_rows: list[PromptLogprobRows]


def prepare_inputs(
    chunks: list[ScheduledChunk],
    block_tables: list[list[int]],  # each chunk's request's table
    backend: MetadataBuilder,
    block_size: int,
    prompt_logprob_targets: dict[str, tuple[int, list[int]]],
    device: torch.device,
) -> ModelInputs:
    """`prompt_logprob_targets`: request id -> (first prompt position still wanting a logprob row,
    the full prompt), for requests that asked for prompt logprobs."""
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    sample_rows: dict[str, int] = {}
    drafts: dict[str, list[int]] = {}
    offset = 0
    for c in chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        positions.extend(range(c.start_position, c.start_position + n))
        wanted = prompt_logprob_targets.get(c.request_id)
        if wanted is not None:
            done, prompt = wanted
            # the logits at position p give the logprob of prompt token p + 1
            first = max(c.start_position, done - 1)
            last = min(c.start_position + n, len(prompt) - 1)  # exclusive
            if first < last:
                prompt_rows.append(PromptLogprobRows(c.request_id, len(rows), prompt[first + 1 : last + 1], first + 1))
                rows.extend(range(offset + first - c.start_position, offset + last - c.start_position))
        if c.sample:
            d = c.num_draft_tokens
            sample_rows[c.request_id] = len(rows)
            rows.extend(range(offset + n - 1 - d, offset + n))
            if d:
                drafts[c.request_id] = c.token_ids[n - d :]
        offset += n
    metadata = backend.build_metadata(
        [len(c.token_ids) for c in chunks],
        [c.start_position + len(c.token_ids) for c in chunks],
        block_tables,
        block_size,
        device,
    )
    # one tensor made for the three (each op after a forward runs on caches the weights just evicted)
    flat = torch.tensor(ids + positions + rows, dtype=torch.int64, device=device)
    input_ids, positions_t, logits_rows = flat.split([len(ids), len(positions), len(rows)])
    return ModelInputs(
        input_ids=input_ids,
        positions=positions_t,
        metadata=metadata,
        logits_rows=logits_rows,
        every_row=len(rows) == len(ids) and rows == list(range(len(ids))),
        sample_rows=sample_rows,
        drafts=drafts,
        prompt_rows=prompt_rows,
    )
