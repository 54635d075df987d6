"""The token-constraint logits processors against hand-computed logits, and through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks, prompts
from tokenmill import LLM, SamplingParams
from tokenmill.layers.token_constraints import (
    AllowedTokensProcessor,
    BadWordsProcessor,
    LogitBiasProcessor,
    MinTokensProcessor,
)

INF = math.inf


def logits(rows: int = 2, vocab: int = 6) -> torch.Tensor:
    return torch.arange(rows * vocab, dtype=torch.float32).reshape(rows, vocab) / 10  # row 0: 0.0 .. 0.5


def test_allowed_tokens_keep_only_theirs():
    p = AllowedTokensProcessor()
    p.add_row(3, SamplingParams(allowed_token_ids=[1, 4]), [], ())
    p.add_row(5, SamplingParams(), [], ())  # asks for nothing: no state, untouched
    assert p.active and 5 not in p.state
    x = logits()
    out = p.apply(x, torch.tensor([5, 3]), [5, 3])
    assert out[0].tolist() == pytest.approx(x[0].tolist())
    assert out[1].tolist() == pytest.approx([-INF, 0.7, -INF, -INF, 1.0, -INF])
    assert x[1, 0] == 0.6  # the input is left as is
    p.move_row(3, 0)
    assert p.apply(x, torch.tensor([0, 5]), [0, 5])[0].tolist() == pytest.approx([-INF, 0.1, -INF, -INF, 0.4, -INF])
    p.remove_row(0)
    assert not p.active


def test_bad_words_bar_the_last_token_after_the_rest():
    p = BadWordsProcessor()
    p.add_row(0, SamplingParams(bad_words_token_ids=[(2,), (4, 5)]), [], ())
    x = logits(1)
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx([0.0, 0.1, -INF, 0.3, 0.4, 0.5])
    p.append_token(0, 4)  # the output now ends with 4: 5 would complete the word (4, 5)
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx([0.0, 0.1, -INF, 0.3, 0.4, -INF])
    p.append_token(0, 1)
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx([0.0, 0.1, -INF, 0.3, 0.4, 0.5])


def test_min_tokens_mask_eos_and_stop_ids_until_reached():
    p = MinTokensProcessor()
    p.add_row(0, SamplingParams(min_tokens=2, stop_token_ids=[3]), [], (5,))
    p.add_row(1, SamplingParams(min_tokens=2, ignore_eos=True), [], (5,))  # no stop ids, EOS ignored: nothing
    p.add_row(2, SamplingParams(min_tokens=0), [], (5,))
    assert list(p.state) == [0]
    x = logits(1)
    masked = [0.0, 0.1, 0.2, -INF, 0.4, -INF]
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx(masked)
    p.append_token(0, 1)
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx(masked)
    p.append_token(0, 1)  # two tokens: reached
    assert p.apply(x, torch.tensor([0]), [0])[0].tolist() == pytest.approx(x[0].tolist()) and not p.active


def test_logit_bias_adds_to_the_listed_tokens():
    p = LogitBiasProcessor()
    p.add_row(1, SamplingParams(logit_bias={0: 100, 5: -100, 2: 0.25}), [], ())
    x = logits(1)
    assert p.apply(x, torch.tensor([1]), [1])[0].tolist() == pytest.approx([100.0, 0.1, 0.45, 0.3, 0.4, -99.5])


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory=64 * 24576)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": 12} | kw))  # type: ignore[arg-type]


def test_through_the_engine(llm):
    p = prompts(1, seed=31)[0]
    eos = llm.engine.tokenizer.info.eos_token_ids[0]
    plain = llm.generate([p], greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # logit_bias: +100 on one token makes it every greedy choice
    forced = llm.generate([p], greedy(logit_bias={17: 100}, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [17] * 12
    # allowed_token_ids: only those, greedy among them
    allowed = llm.generate([p], greedy(allowed_token_ids=[40, 41, 42]), use_tqdm=False)[0].outputs[0]
    assert set(allowed.token_ids) <= {40, 41, 42} and allowed.token_ids
    # min_tokens: EOS forced by its bias is still masked for the first 5 tokens, then ends the request
    early = llm.generate([p], greedy(logit_bias={eos: 100}, min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) == 6 and early.token_ids[-1] == eos and eos not in early.token_ids[:5]
    assert early.finish_reason == "stop"
    # bad_words: the first word of the plain output never appears
    word = llm.engine.tokenizer.decode(plain.token_ids[:1]).strip()
    assert word
    barred = llm.generate([p], greedy(bad_words=[word], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert barred.token_ids != plain.token_ids and barred.token_ids[:1] != plain.token_ids[:1]
    with pytest.raises(ValueError, match="logit_bias: token id 99999 is outside the model's vocabulary"):
        llm.generate([p], greedy(logit_bias={99999: 1}), use_tqdm=False)
    assert_no_leaks(llm)


def test_min_tokens_holds_stop_strings_back(llm):
    p = prompts(1, seed=32)[0]
    full = llm.generate([p], greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text[:2]  # would stop at once
    assert llm.generate([p], greedy(ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0].text == ""
    late = llm.generate([p], greedy(ignore_eos=True, stop=[stop], min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert late.token_ids == full.token_ids  # the stop string is not checked before min_tokens
    assert_no_leaks(llm)


def reference(params: SamplingParams, output: list[int], eos: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """The processors' semantics one token at a time, for one row [V] (ids past the width skipped)."""
    x, width = x.clone(), x.shape[0]
    if params.allowed_token_ids is not None:
        keep = torch.full((width,), -INF)
        for t in params.allowed_token_ids:
            if t < width:
                keep[t] = x[t]
        x = keep
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if word[-1] < width and (not prefix or output[len(output) - len(prefix) :] == prefix):
            x[word[-1]] = -INF
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    if len(output) < params.min_tokens:
        for t in stops:
            if t < width:
                x[t] = -INF
    for t, bias in (params.logit_bias or {}).items():
        if t < width:
            x[t] += bias
    return x


def test_the_processors_agree_with_a_token_at_a_time_reference_on_random_rows():
    rng = torch.Generator().manual_seed(3)
    procs = [AllowedTokensProcessor(), BadWordsProcessor(), MinTokensProcessor(), LogitBiasProcessor()]
    width, rows, eos = 40, 12, (2,)

    def ids(n: int, high: int = width + 5) -> list[int]:  # (some past the width: a larger tokenizer)
        return torch.randint(0, high, (n,), generator=rng).tolist()

    shared_words = tuple(tuple(ids(int(torch.randint(1, 4, (1,), generator=rng)), 8)) for _ in range(30))
    params, outputs = {}, {}
    for row in range(rows):
        pick = torch.rand(5, generator=rng).tolist()
        words = shared_words if row % 3 == 0 else tuple(tuple(ids(1 + row % 3, 8)) for _ in range(row))
        params[row] = SamplingParams(
            allowed_token_ids=sorted(set(ids(20))) if pick[0] < 0.4 else None,
            bad_words_token_ids=words if pick[1] < 0.7 else (),
            min_tokens=int(pick[2] * 6),
            stop_token_ids=ids(3),
            ignore_eos=pick[3] < 0.3,
            logit_bias={t: float(t % 7) - 3 for t in ids(6)} if pick[4] < 0.6 else None,
        )
        outputs[row] = []
        for p in procs:
            p.add_row(row, params[row], [], eos)
    for _ in range(8):  # steps: each row's output grows from the bad words' own tokens, so prefixes match
        x = torch.randn(rows, width, generator=rng)
        order = torch.randperm(rows, generator=rng).tolist()
        y = x
        for p in procs:
            if p.active:
                y = p.apply(y, torch.tensor(order), order)
        for i, row in enumerate(order):
            want = reference(params[row], outputs[row], eos, x[i])
            assert torch.equal(torch.isinf(y[i]), torch.isinf(want)), (row, outputs[row])
            finite = ~torch.isinf(want)
            assert torch.allclose(y[i][finite], want[finite])
        for row in range(rows):
            token = int(torch.randint(0, 8, (1,), generator=rng))
            outputs[row].append(token)
            for p in procs:
                p.append_token(row, token)
    shared = procs[1]
    assert len({id(shared.state[r][1]) for r in range(0, rows, 3) if r in shared.state}) <= 1  # one list, shared
    for row in range(rows):
        for p in procs:
            p.remove_row(row)
    assert not any(p.active for p in procs) and not shared._shared._by_key
