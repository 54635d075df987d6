"""The runner's persistent batch: rows that join, leave and move sample exactly as a fresh batch does."""

from __future__ import annotations

import random

import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata
from tokenmill.outputs import NewRequestData
from tokenmill.runner.input_batch import InputBatch
from tokenmill.sampling_params import SamplingParams

VOCAB = 50

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, logprobs=2),
    "penalised-greedy": SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7),
    "sampled": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1),
    "penalised-sampled": SamplingParams(temperature=1.2, presence_penalty=1.0, min_p=0.05, seed=2),
    "plain": SamplingParams(temperature=1.0, seed=3),
}


def fresh(batch: InputBatch, ids: list[str]) -> SamplingMetadata:
    """The same rows built from scratch, as a one-off batch would be."""
    states = [batch.state(i) for i in ids]
    return SamplingMetadata.from_params(
        [s.params for s in states],
        [s.seed for s in states],
        [len(s.output_token_ids) for s in states],
        [s.prompt_token_ids for s in states],
        [s.output_token_ids for s in states],
        VOCAB,
    )


def test_rows_joining_leaving_and_moving_sample_as_a_fresh_batch():
    rng = random.Random(0)
    batch = InputBatch(capacity=2, vocab_size=VOCAB)  # grows twice below
    sampler = Sampler()
    names = list(PARAMS)
    for i, name in enumerate(names):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        batch.add(NewRequestData(name, prompt, PARAMS[name], seed=100 + i))
    assert batch.capacity == 8 and len(batch) == 5
    penalised_at_some_step = False
    for step in range(12):
        if step == 3:
            batch.remove("penalised-greedy")  # the last row ("plain") moves into row 1
            assert batch.row_of["plain"] == 1 and "penalised-greedy" not in batch
        if step == 5:
            batch.add(NewRequestData("late", [1, 2, 3], SamplingParams(repetition_penalty=0.7, seed=9), seed=9))
        if step == 8:
            batch.remove("greedy")  # row 0: the newest row moves to the front
        ids = list(batch.row_of)
        rng.shuffle(ids)  # a step samples its rows in any order (and only some of them)
        ids = ids[: max(1, len(ids) - step % 2)]
        logits = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        persistent = batch.sampling_metadata(ids)
        reference = fresh(batch, ids)
        penalised_at_some_step |= bool(persistent.processors)
        assert torch.equal(sampler.probabilities(logits, persistent), sampler.probabilities(logits, reference))
        ours, theirs = sampler(logits, persistent), sampler(logits, reference)
        assert torch.equal(ours.token_ids, theirs.token_ids)
        for request_id, token in zip(ids, ours.token_ids.tolist(), strict=True):
            batch.append_tokens([request_id], [token])
    assert penalised_at_some_step
    assert sorted(batch.row_of) == ["late", "penalised-sampled", "plain", "sampled"]
    assert sorted(batch.row_of.values()) == [0, 1, 2, 3]  # rows stay dense
    assert [batch.rows[r].request_id for r in range(4)] == sorted(batch.row_of, key=batch.row_of.__getitem__)


def test_a_removed_rows_state_does_not_leak_into_its_successor():
    batch = InputBatch(capacity=4, vocab_size=VOCAB)
    batch.add(NewRequestData("a", [5, 6], SamplingParams(temperature=0.0, frequency_penalty=2.0), seed=0))
    for token in (7, 7, 8):
        batch.append_tokens(["a"], [token])
    batch.remove("a")
    assert not batch.penalties.active
    batch.add(NewRequestData("b", [9], SamplingParams(temperature=0.0, presence_penalty=1.0), seed=0))
    counts, prompt_seen = batch.penalties._state()
    assert counts[0].sum() == 0 and prompt_seen[0].nonzero().flatten().tolist() == [9]
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 0.5  # "a"'s penalised favourite: no penalty left on it for "b"
    assert Sampler()(logits, batch.sampling_metadata(["b"])).token_ids.tolist() == [7]
