"""The sampler against a slow, obviously-correct reference: penalties, greedy, the processed
distribution (temperature, top-k, top-p, min-p), exact and reproducible sampling, logprobs."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from tokenmill.outputs import NewRequestData
from tokenmill.runner.input_batch import InputBatch
from tokenmill.sampling_params import SamplingParams, generator_seed

Row = tuple[SamplingParams, int, int, list[int], list[int]]  # params, seed, output position, prompt, output


# ----------------------------------------------------------------------------- reference


def ref_penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[V] float64 logits after HF's repetition penalty, then OpenAI's frequency and presence penalties."""
    x = logits.double().clone()
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x


def ref_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[V] float64: the distribution one row samples from, one step at a time, in plain Python."""
    x = ref_penalised(logits, p, prompt, output)
    vocab = len(x)
    if p.greedy:
        probs = torch.zeros(vocab, dtype=torch.float64)
        probs[int(x.argmax())] = 1.0
        return probs
    x = x / p.temperature
    keep = [True] * vocab
    if p.top_k is not None:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, vocab) - 1]
        keep = [float(v) >= kth for v in x]

    def renormalised() -> torch.Tensor:
        masked = torch.tensor([float(v) if k else float("-inf") for v, k in zip(x, keep, strict=True)])
        return torch.softmax(masked.double(), dim=0)

    probs = renormalised()
    order = sorted(range(vocab), key=lambda i: -float(probs[i]))
    top_p_keep = [False] * vocab
    cumulative = 0.0
    for i in order:  # the smallest prefix of the sorted distribution that reaches top_p
        if probs[i] == 0:
            break
        top_p_keep[i] = True
        cumulative += float(probs[i])
        if cumulative >= p.top_p:
            break
    keep = [a and b for a, b in zip(keep, top_p_keep, strict=True)]
    probs = renormalised()
    top = float(probs.max())
    keep = [k and float(q) >= p.min_p * top for k, q in zip(keep, probs, strict=True)]
    return renormalised()


def metadata(rows: list[Row], vocab: int) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        [r[0] for r in rows],
        seeds=[r[1] for r in rows],
        output_positions=[r[2] for r in rows],
        prompt_token_ids=[r[3] for r in rows],
        output_token_ids=[r[4] for r in rows],
        vocab_size=vocab,
    )


def history(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


VOCAB = 64
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=1e-9),  # only the top token (1 - top_p rounds to 1 in float32)
    SamplingParams(temperature=1.0, top_k=1),  # greedy-like
    SamplingParams(temperature=0.5, min_p=1.0),  # only the top token(s)
    SamplingParams(temperature=1.0, top_k=VOCAB + 5),  # clamped to the vocabulary
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(temperature=1.1, top_k=20, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.6, top_p=0.9, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=-1.0),
]


def mixed_batch(seed: int) -> tuple[torch.Tensor, list[Row]]:
    rng = random.Random(seed)
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    rows = [(p, 1000 + i, i, history(rng, VOCAB, 12), history(rng, VOCAB, 9)) for i, p in enumerate(PARAMS)]
    return logits, rows


# ----------------------------------------------------------------------------- metadata


def test_from_params_builds_the_tensors() -> None:
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.4),
        SamplingParams(top_k=500),
    ]
    md = SamplingMetadata.from_params(params, [7, 8, 9], [0, 4, 2], [[1], [2, 3], []], [[], [5], [6, 6]], 100)
    assert md.temperature.dtype == torch.float32 and md.temperature.tolist() == [0.5, 0.0, 1.0]
    assert md.top_k.dtype == torch.int64 and md.top_k.tolist() == [3, 100, 100]  # None and > vocab -> vocab
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0])
    (penalties,) = md.processors  # row 1 asks for penalties: the processor is active
    assert penalties.repetition.tolist() == pytest.approx([1.0, 1.2, 1.0])
    assert penalties.presence.tolist() == pytest.approx([0.0, 0.3, 0.0])
    assert penalties.frequency.tolist() == pytest.approx([0.0, -0.4, 0.0])
    for t in (md.top_p, md.min_p, penalties.repetition, penalties.presence, penalties.frequency):
        assert t.dtype == torch.float32 and t.shape == (3,)
    assert md.seeds == [7, 8, 9] and md.output_positions == [0, 4, 2] and md.batch_rows.tolist() == [0, 1, 2]
    assert penalties.penalised == [False, True, False]
    counts, prompt_seen = penalties._state()
    assert counts[1].nonzero().flatten().tolist() == [5] and prompt_seen[1].nonzero().flatten().tolist() == [2, 3]
    assert md.max_num_logprobs == 2 and md.logprobs_requested
    assert not md.all_greedy

    plain = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * 2, [1, 2], [0, 0], [[], []], [[], []], 10)
    assert plain.all_greedy and plain.processors == []  # no row asks for penalties: nothing to apply
    assert plain.max_num_logprobs == 0 and not plain.logprobs_requested
    zero = SamplingMetadata.from_params([SamplingParams(logprobs=0)], [1], [0], [[]], [[]], 10)
    assert zero.max_num_logprobs == 0 and zero.logprobs_requested

    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.from_params(params, [1], [0, 0, 0], [[]] * 3, [[]] * 3, 100)


def test_generator_seed_is_a_fixed_mix() -> None:
    # SplitMix64's first output from state 0 is 0xE220A8397B1DCDAF: the mix is the published one.
    from tokenmill.sampling_params import _splitmix64

    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert generator_seed(1, 2) == generator_seed(1, 2)
    assert generator_seed(1, 2) != generator_seed(2, 1)
    assert generator_seed(-1, 0) == generator_seed(2**64 - 1, 0)
    for seed, position in [(0, 0), (-5, 3), (2**70 + 3, 10**9)]:
        assert 0 <= generator_seed(seed, position) < 2**64


# ----------------------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * 5, [0] * 5, [0] * 5, [[]] * 5, [[]] * 5, 100)
    assert md.all_greedy
    out = Sampler()(logits, md)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_greedy_with_penalties_matches_reference() -> None:
    vocab = 12
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * 2
    rng = random.Random(1)
    rows: list[Row] = []
    for i in range(6):
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=[1.0, 1.8, 0.6][i % 3],
            presence_penalty=[0.0, 1.5, -1.0][i % 3],
            frequency_penalty=[0.9, 0.0, 2.0][i % 3],
        )
        rows.append((p, i, 0, history(rng, vocab, 5), history(rng, vocab, 6)))
    md = metadata(rows, vocab)
    assert md.all_greedy and md.processors
    expected = [int(ref_penalised(logits[i], *(r[0], r[3], r[4])).argmax()) for i, r in enumerate(rows)]
    assert Sampler()(logits, md).token_ids.tolist() == expected
    # The penalties must change the outcome somewhere, or this test proves little.
    assert expected != logits.argmax(dim=-1).tolist()


def test_penalties_do_not_modify_the_input() -> None:
    logits, rows = mixed_batch(3)
    before = logits.clone()
    Sampler()(logits, metadata(rows, VOCAB))
    Sampler().probabilities(logits, metadata(rows, VOCAB))
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- the distribution


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_probabilities_match_reference(seed: int) -> None:
    logits, rows = mixed_batch(seed)
    probs = Sampler().probabilities(logits, metadata(rows, VOCAB))
    assert probs.shape == (len(rows), VOCAB) and probs.dtype == torch.float32
    for i, (p, _, _, prompt, output) in enumerate(rows):
        expected = ref_probs(logits[i], p, prompt, output)
        assert torch.equal(probs[i] > 0, expected > 0), f"support of row {i} ({p})"
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-6, rtol=0, msg=f"row {i} ({p})")
    top = logits.argmax(dim=-1)
    for i in (5, 6, 7, 9):  # top_p tiny, top_k=1, min_p=1, greedy: only the top token
        assert probs[i].nonzero().flatten().tolist() == [int(top[i])]


def test_support_edge_cases_with_ties() -> None:
    logits = torch.tensor(
        [
            [3.0, 2.0, 2.0, 2.0, 1.0, 0.0],  # top_k=2: the tie at the boundary keeps all three 2.0s
            [2.0, 2.0, 1.0, 0.0, -1.0, -2.0],  # min_p=1: both tokens tied at the top stay
            [0.0, 5.0, 1.0, 4.0, 2.0, 3.0],  # top_k=3 and a generous top_p
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # uniform: top_p=0.45 keeps exactly three
            [1.0, 1.0, 1.0, 1.0, float("-inf"), float("-inf")],  # 0.25 each: top_p=0.5 is reached at two
        ]
    )
    params = [
        SamplingParams(top_k=2),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=3, top_p=0.999),
        SamplingParams(top_p=0.45),
        SamplingParams(top_p=0.5),
    ]
    md = SamplingMetadata.from_params(params, [0] * 5, [0] * 5, [[]] * 5, [[]] * 5, 6)
    probs = Sampler().probabilities(logits, md)
    assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert (probs[1] > 0).nonzero().flatten().tolist() == [0, 1]
    assert (probs[2] > 0).nonzero().flatten().tolist() == [1, 3, 5]
    assert int((probs[3] > 0).sum()) == 3
    assert int((probs[4] > 0).sum()) == 2 and float(probs[4].max()) == 0.5
    for i, p in enumerate(params):
        if i < 3:  # the reference picks among equal tokens in its own order
            torch.testing.assert_close(probs[i].double(), ref_probs(logits[i], p, [], []), atol=1e-6, rtol=0)


def test_top_k_alone_matches_reference() -> None:
    # No row uses top-p here, so top-k runs without a full sort.
    logits = torch.cat(
        [
            torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0] + [-1.0] * 26]),
            torch.randn(3, 32, generator=torch.Generator().manual_seed(9)) * 2,
        ]
    )
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_k=7, temperature=0.6),
        SamplingParams(),
        SamplingParams(top_k=1),
    ]
    md = SamplingMetadata.from_params(params, [0] * 4, [0] * 4, [[]] * 4, [[]] * 4, 32)
    probs = Sampler().probabilities(logits, md)
    assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert int((probs[1] > 0).sum()) == 7 and bool((probs[2] > 0).all()) and int((probs[3] > 0).sum()) == 1
    for i, p in enumerate(params):
        torch.testing.assert_close(probs[i].double(), ref_probs(logits[i], p, [], []), atol=1e-6, rtol=0)


def test_tiny_temperature_does_not_overflow() -> None:
    logits = torch.tensor([[10.0, 30.0, -5.0, 29.9]])
    md = SamplingMetadata.from_params([SamplingParams(temperature=1e-30)], [0], [0], [[]], [[]], 4)
    probs = Sampler().probabilities(logits, md)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert Sampler()(logits, md).token_ids.tolist() == [1]


# ----------------------------------------------------------------------------- sampling


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support].double() * n
    observed = counts[support].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize(
    ("params", "vary"),
    [
        (SamplingParams(temperature=0.9, top_k=6, top_p=0.97), "position"),
        (SamplingParams(temperature=1.5, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3), "seed"),
    ],
)
def test_samples_follow_the_distribution(params: SamplingParams, vary: str) -> None:
    vocab, n = 8, 3000
    row_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = row_logits.expand(n, vocab).contiguous()
    seeds = list(range(n)) if vary == "seed" else [1234] * n
    positions = list(range(n)) if vary == "position" else [7] * n
    md = SamplingMetadata.from_params([params] * n, seeds, positions, [[0, 1]] * n, [[1, 1, 2]] * n, vocab)
    probs = Sampler().probabilities(
        logits[:1], SamplingMetadata.from_params([params], [0], [0], [[0, 1]], [[1, 1, 2]], vocab)
    )[0]
    tokens = Sampler()(logits, md).token_ids
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[probs == 0].sum()) == 0  # nothing outside the support
    stat, dof = chi_square(counts, probs, n)
    assert dof >= 3
    # Mean dof, sd sqrt(2 dof): this bound is about 6 sd out; the seeds are fixed anyway.
    assert stat < dof + 6 * (2 * dof) ** 0.5, (stat, dof, counts.tolist(), (probs * n).tolist())


def sample_rows(rows: list[Row], logits: torch.Tensor, vocab: int) -> list[int]:
    return Sampler()(logits, metadata(rows, vocab)).token_ids.tolist()


def test_sampling_is_reproducible_and_batch_independent() -> None:
    vocab = 200
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.02, presence_penalty=0.4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=30, top_p=0.95, min_p=0.01, repetition_penalty=1.1),
    ]
    rows = [
        (p, 11 * i + 3, rng.randrange(50), history(rng, vocab, 8), history(rng, vocab, 8)) for i, p in enumerate(params)
    ]
    logits = torch.randn(len(rows), vocab, generator=gen) * 0.5  # flat: many tokens are possible

    alone = [sample_rows([row], logits[i : i + 1], vocab)[0] for i, row in enumerate(rows)]
    assert sample_rows(rows, logits, vocab) == alone
    assert sample_rows(rows, logits, vocab) == alone  # again: same (seed, position), same token

    others: list[Row] = [(SamplingParams(temperature=0.9, top_k=k), 99, k, [], [1, 2]) for k in (3, 10, 150, 200)]
    all_rows = rows + others
    all_logits = torch.cat([logits, torch.randn(len(others), vocab, generator=gen)])
    for order_seed in range(3):
        order = list(range(len(all_rows)))
        random.Random(order_seed).shuffle(order)
        tokens = sample_rows([all_rows[j] for j in order], all_logits[order], vocab)
        by_row = dict(zip(order, tokens, strict=True))
        assert [by_row[i] for i in range(len(rows))] == alone

    # The same row's probabilities alone and inside the batch are bit-identical.
    batch_probs = Sampler().probabilities(all_logits, metadata(all_rows, vocab))
    for i, row in enumerate(rows):
        assert torch.equal(Sampler().probabilities(logits[i : i + 1], metadata([row], vocab))[0], batch_probs[i])

    # Randomness really depends on the position (and the seed).
    p, seed, _, prompt, output = rows[0]
    over_positions = sample_rows(
        [(p, seed, pos, prompt, output) for pos in range(40)], logits[0].expand(40, vocab), vocab
    )
    over_seeds = sample_rows([(p, s, 0, prompt, output) for s in range(40)], logits[0].expand(40, vocab), vocab)
    assert len(set(over_positions)) > 10 and len(set(over_seeds)) > 10


def test_mixed_batch_greedy_rows_take_the_penalised_argmax() -> None:
    logits, rows = mixed_batch(4)
    tokens = Sampler()(logits, metadata(rows, VOCAB)).token_ids
    for i, (p, _, _, prompt, output) in enumerate(rows):
        if p.greedy:
            assert int(tokens[i]) == int(ref_penalised(logits[i], p, prompt, output).argmax())
        else:
            assert float(ref_probs(logits[i], p, prompt, output)[tokens[i]]) > 0


@contextlib.contextmanager
def no_host_reads(monkeypatch) -> Iterator[None]:
    """Every read of a tensor's value by the host raises inside (a GPU would wait for the device there)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a tensor's value read on the host")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, refuse)
        yield


def test_the_sampler_reads_no_tensor_value_on_the_host(monkeypatch) -> None:
    """On a GPU each read of a tensor's value by the host waits for the device: the sampler branches on
    the metadata's host-side fields only. Here every such read raises while a mixed batch (greedy,
    top-k, top-p, min-p, penalties, logprobs) is sampled; the tokens are then read once, as the runner does."""
    logits, rows = mixed_batch(5)
    rows = [(dataclasses.replace(r[0], logprobs=2), *r[1:]) for r in rows]
    md = metadata(rows, VOCAB)
    expected = Sampler()(logits, md)

    with no_host_reads(monkeypatch):
        out = Sampler()(logits, md)
    assert torch.equal(out.token_ids, expected.token_ids)
    assert out.logprobs is not None and torch.equal(out.logprobs.topk_ids, expected.logprobs.topk_ids)


def test_the_persistent_batch_with_every_processor_reads_no_tensor_value_on_the_host(monkeypatch) -> None:
    """The same with the runner's persistent batch and its token constraints (allowed tokens, bad words,
    min_tokens, logit_bias) and penalties active, rows out of order."""
    batch = InputBatch(capacity=8, vocab_size=VOCAB)
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 5, 7]),
        SamplingParams(temperature=0.9, bad_words_token_ids=[[4], [9, 2]], seed=1),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6], logit_bias={8: 5.0}),
        SamplingParams(temperature=1.1, top_k=5, repetition_penalty=1.3, logprobs=1, seed=2),
    ]
    for i, p in enumerate(params):
        batch.add(NewRequestData(f"r{i}", [1, 2, 9], p, seed=i, eos_token_ids=(0,)))
    batch.append_tokens(["r1", "r3"], [9, 4])
    ids = ["r3", "r0", "r2", "r1"]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    md = batch.sampling_metadata(ids)
    expected = Sampler()(logits, md)

    with no_host_reads(monkeypatch):
        out = Sampler()(logits, md)
    assert torch.equal(out.token_ids, expected.token_ids)
    assert int(out.token_ids[1]) in (3, 5, 7) and int(out.token_ids[2]) not in (0, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_on_a_gpu_never_synchronizes() -> None:
    logits, rows = mixed_batch(6)
    md = SamplingMetadata.from_params(
        [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
        [r[4] for r in rows], VOCAB, "cuda",
    )  # fmt: skip
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    on_cpu = Sampler()(logits.cpu(), metadata(rows, VOCAB)).token_ids  # (sampled rows: another generator's draws)
    greedy = torch.tensor([r[0].greedy for r in rows])
    assert torch.equal(out.token_ids.cpu()[greedy], on_cpu[greedy])


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_logits() -> None:
    logits, rows = mixed_batch(6)
    asks = [3, None, 5, 0, None, 1, 2, None, None, 4, 5, 0, None]
    rows = [(dataclasses.replace(r[0], logprobs=k), *r[1:]) for r, k in zip(rows, asks, strict=True)]
    md = metadata(rows, VOCAB)
    assert md.max_num_logprobs == 5
    out = Sampler()(logits, md)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(raw, 5, dim=-1)
    assert torch.equal(out.logprobs.topk_ids, ids)
    torch.testing.assert_close(out.logprobs.topk_logprobs, values)
    tokens = out.token_ids
    chosen = raw.gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs.chosen_logprobs, chosen)
    assert out.logprobs.chosen_ranks.dtype == torch.int64
    assert out.logprobs.chosen_ranks.tolist() == [int((raw[i] > chosen[i]).sum()) + 1 for i in range(len(rows))]
    # Greedy without penalties (row 9), top_k=1 (row 6) and top_p tiny (row 5): the most likely raw token.
    assert [int(out.logprobs.chosen_ranks[i]) for i in (5, 6, 9)] == [1, 1, 1]


def test_logprobs_absent_or_empty() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(8))
    none = SamplingMetadata.from_params([SamplingParams()] * 3, [1, 2, 3], [0] * 3, [[]] * 3, [[]] * 3, 20)
    assert Sampler()(logits, none).logprobs is None

    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(), SamplingParams(logprobs=0)]
    zero = SamplingMetadata.from_params(params, [1, 2, 3], [0] * 3, [[]] * 3, [[]] * 3, 20)
    out = Sampler()(logits, zero)
    assert out.logprobs is not None
    assert out.logprobs.topk_ids.shape == (3, 0) and out.logprobs.topk_logprobs.shape == (3, 0)
    assert out.logprobs.chosen_logprobs.shape == (3,) and int(out.logprobs.chosen_ranks[0]) == 1


def test_gather_logprobs() -> None:
    raw = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, -1.0, 4.0, 2.0]]), dim=-1)
    targets = torch.tensor([2, 0])
    out = gather_logprobs(raw, targets, 2)
    assert out.topk_ids[1].tolist() == [2, 3]
    assert sorted(out.topk_ids[0].tolist()) == [1, 3]  # tied at the top
    torch.testing.assert_close(out.topk_logprobs, torch.topk(raw, 2, dim=-1).values)
    torch.testing.assert_close(out.chosen_logprobs, torch.stack([raw[0, 2], raw[1, 0]]))
    assert out.chosen_ranks.tolist() == [3, 3]
    assert gather_logprobs(raw, torch.tensor([1, 2]), 2).chosen_ranks.tolist() == [1, 1]  # a tie for first is rank 1

    empty = gather_logprobs(raw, targets, 0)
    assert empty.topk_ids.shape == (2, 0) and empty.topk_ids.dtype == torch.int64
    assert empty.topk_logprobs.shape == (2, 0)
    assert empty.chosen_ranks.tolist() == [3, 3]
