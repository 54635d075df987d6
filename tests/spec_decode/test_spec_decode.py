"""Speculative decoding with prompt-lookup drafts: the proposer's lookups, the config's checks, and
the engine's outputs with speculation equal to those without it (greedy, seeded sampling, stop
strings, logprobs, n > 1; batch 1 and 16; under preemption), with drafts proposed and accepted, the
counters consistent, and no KV block leaked."""

from __future__ import annotations

import itertools
import json
import random

import httpx
import pytest

from tests.engine.test_engine import assert_no_leaks, greedy, same_up_to_near_tie
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.sched.draft_policy import Drafting
from tokenmill.sched.spec_policy import Candidate, SpeculationPolicy, StepCurve
from tokenmill.spec_decode import DraftRequest, NgramProposer


def ngram(k: int = 3, adaptive: bool = False) -> dict[str, object]:
    """Prompt lookup with k drafts; not adaptive unless asked: every draft is verified (what the
    equality tests need: a measured rule could decide none pays on this machine)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "adaptive": adaptive}


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup feeds on), with random tokens between."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(5, 4096) for _ in range(rng.randint(3, 8))]
        filler = [rng.randrange(5, 4096) for _ in range(rng.randint(0, 10))]
        out.append(phrase + filler + phrase * rng.randint(1, 4) + phrase[: rng.randint(1, len(phrase))])
    return out


# ----------------------------------------------------------------------------- the proposer


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 3)
    asks = [
        DraftRequest("a", [1, 2, 3, 4, 5, 1, 2, 3], 3),  # [1, 2, 3] seen at 0: 4, 5, 1 followed
        DraftRequest("b", [9, 2, 3, 7, 5, 2, 3, 8, 6, 2, 3], 2),  # the latest earlier [2, 3] (at 5): 8, 6
        DraftRequest("c", [1, 2, 3, 4, 1, 2, 3], 9),  # fewer than k tokens follow: what there is
        DraftRequest("d", [1, 2, 3], 2),  # nothing repeats
        DraftRequest("e", [256, 1, 256], 2),  # token values across byte boundaries match as tokens
        DraftRequest("f", [1, 256, 7, 1], 2),  # (256 = bytes 00 01 00 00: 1's bytes occur inside it)
        DraftRequest("g", [4, 5, 4, 5], 0),  # no room
    ]
    assert p.propose(asks) == [[4, 5, 1], [8, 6], [4, 1, 2, 3], [], [1, 256], [256, 7], []]
    assert NgramProposer(2, 3).propose([DraftRequest("h", [7, 1, 8, 1], 2)]) == [[]]  # 1-grams are not tried


def test_a_lookup_at_a_position_of_one_buffer_proposes_what_the_tokens_before_it_alone_do():
    """`propose_at` (the doctor's teacher-forced lookups along a prompt, one buffer for every position)
    against `propose` on each prefix, on sequences that repeat (matches across token boundaries
    included: ids whose bytes overlap)."""
    from array import array

    rng = random.Random(3)
    for min_n, max_n, k in ((1, 4, 5), (2, 3, 2), (1, 1, 8)):
        p = NgramProposer(min_n, max_n)
        for _ in range(30):
            vocab = rng.choice([[1, 2, 3], [256, 1, 65536, 257], list(range(40))])
            seq = [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
            tokens = array("i", seq)
            buf = tokens.tobytes()
            for t in range(len(seq) + 1):
                assert p.propose_at(tokens, buf, t, k) == p.propose([DraftRequest("x", seq[:t], k)])[0], (seq, t)


def test_the_speculative_config_names_what_is_wrong():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_max == 4
    for bad, message in (
        ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method: expected one of ngram"),
        ('{"method": "ngram"}', "speculative_config.num_speculative_tokens: required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 16}',
            "num_speculative_tokens: expected an integer from 1 to 15",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "speculative_config.k: unknown key"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}', "prompt_lookup_min: 5 is more"),
        ("[2]", "speculative_config: expected a JSON object"),
        ("{", "speculative_config: not valid JSON"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


# ----------------------------------------------------------------------------- the measured rule


def test_the_step_curve_interpolates_what_it_measured():
    curve = StepCurve()
    assert curve.seconds(4) is None
    for tokens, seconds in ((1, 1.0), (8, 2.0), (64, 9.0)):
        curve.observe(tokens, seconds)
    assert curve.seconds(1) == 1.0 and curve.seconds(8) == 2.0
    assert curve.seconds(36) == pytest.approx(2.0 + 7.0 * 28 / 56)  # between the buckets' points
    assert curve.seconds(500) == 9.0  # past the longest step measured: as that one, until measured
    curve.observe(9, 4.0)  # same bucket as 8 (4 bits): a running average of count and time
    n, t = curve.buckets[4]
    assert (n, t) == pytest.approx((8.2, 2.4))


def policy_with(curve: dict[int, float]) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    for tokens, seconds in curve.items():
        policy.curve.observe(tokens, seconds)
    return policy


def kept_at(rate: float, drafts: int = 3) -> Candidate:
    """A candidate whose drafts were each kept at `rate` when reached, over 100 verifications a position."""
    return Candidate("", drafts, reached=[100] * drafts, kept=[round(100 * rate)] * drafts)


def named(c: Candidate, name: str) -> Candidate:
    c.request_id = name
    return c


def test_acceptance_by_position_compounds():
    """Draft j's expected tokens: the product of the conditional rates up to j, a request's own counts
    pulled toward the engine-wide ones (none yet here: the optimistic 3/4) by a prior worth 4
    verifications."""
    gains = SpeculationPolicy().gains(Candidate("a", 3, reached=[100, 50, 40], kept=[50, 40, 40]))
    c = [(50 + 3) / (100 + 4), (40 + 3) / (50 + 4), (40 + 3) / (40 + 4)]
    assert gains == pytest.approx([c[0], c[0] * c[1], c[0] * c[1] * c[2]])


def test_the_rule_speculates_where_a_longer_step_costs_little_and_not_where_it_costs_its_tokens():
    flat = {1: 0.010, 4: 0.0105, 16: 0.012, 64: 0.02}  # one request: weights read, tokens nearly free
    steep = {16: 0.1, 32: 0.2, 64: 0.4, 128: 0.8}  # a large batch: every token costs its share
    good = [named(kept_at(0.8), str(i)) for i in range(32)]  # drafts kept 80% of the time
    assert policy_with(flat).choose(1, 0, good[:1]) == {"0": 3}  # 1 + 0.8 + 0.64 + 0.51 tokens, step +12%
    assert policy_with(steep).choose(32, 0, good) == {}  # 32 + 96 tokens would cost 4x
    poor = [named(kept_at(0.01), "0")]  # its drafts are almost never kept: not worth even a cheap token
    assert policy_with({1: 0.010, 4: 0.012}).choose(1, 0, poor) == {}
    # in between, the best count: the first drafts of the requests most likely to keep them
    mixed = [named(kept_at(0.95), "a"), named(kept_at(0.05), "b")]
    middle = policy_with({2: 0.010, 4: 0.0102, 8: 0.03}).choose(2, 0, mixed)
    assert middle.get("a", 0) >= 1 and middle.get("b", 0) == 0
    assert SpeculationPolicy().choose(1, 0, good[:1]) == {}  # nothing measured yet: plain decoding


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def plain(llama) -> LLM:
    return LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)


def assert_counts_consistent(llm: LLM) -> None:
    s = llm.stats()
    assert s.spec_decode_num_drafts > 0 and s.spec_decode_num_accepted_tokens > 0  # verification ran and paid
    assert s.spec_decode_num_accepted_tokens <= s.spec_decode_num_draft_tokens
    per_pos = s.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == s.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos))  # position j needs j - 1 accepted
    assert 0 < s.spec_decode_acceptance_rate <= 1 and s.spec_decode_mean_accepted_length > 1


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_outputs_with_speculation_equal_those_without(llama, plain, k):
    ps = repetitive_prompts(16, seed=k)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=ngram(k))
    batched = spec.generate(ps, greedy(), use_tqdm=False)  # 16 at once
    alone = [spec.generate([p], greedy(), use_tqdm=False)[0] for p in ps[:4]]  # one at a time
    reference = plain.generate(ps, greedy(), use_tqdm=False)
    for out, ref in zip(batched, reference, strict=True):
        assert same_up_to_near_tie(out, ref)
    for out, ref in zip(alone, reference[:4], strict=True):
        assert same_up_to_near_tie(out, ref)
    assert_counts_consistent(spec)
    assert_no_leaks(spec)


def test_speculation_under_preemption_keeps_the_outputs(llama, plain):
    ps = repetitive_prompts(32, seed=7)
    # ~13 blocks of 16 tokens for up to 16 sequences: preemption is certain, drafts need room too
    tight = LLM(
        llama,
        max_num_seqs=16,
        max_num_batched_tokens=40,
        kv_cache_memory=13 * 24576,
        max_model_len=128,
        speculative_config=ngram(4),
    )
    out = tight.generate(ps, greedy(), use_tqdm=False)
    assert tight.stats().preemptions > 0
    reference = plain.generate(ps, greedy(), use_tqdm=False)
    assert all(same_up_to_near_tie(a, b) for a, b in zip(out, reference, strict=True))
    assert_counts_consistent(tight)
    assert_no_leaks(tight)


def test_seeded_sampling_with_speculation_is_the_same_sample(llama, plain):
    """A row's token is a function of its logits and (seed, output position): verifying a draft against
    the target's own seeded sample keeps every output what it is without speculation."""
    ps = repetitive_prompts(8, seed=3)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=ngram(3))
    params = [SamplingParams(temperature=0.7, top_k=20, seed=s, max_tokens=24, ignore_eos=True) for s in range(8)]
    # (low temperature: the random model repeats itself, so drafts get accepted)
    params += [SamplingParams(temperature=0.3, top_p=0.9, max_tokens=24, ignore_eos=True, n=2, seed=99)]
    ps = ps + ps[:1]
    got = spec.generate(ps, params, use_tqdm=False)
    want = plain.generate(ps, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert spec.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_stop_strings_and_logprobs_with_speculation(llama, plain):
    """Tokens verified in one step past a stop string are dropped, as one token a step never made them;
    each kept token carries its own logprobs."""
    ps = repetitive_prompts(6, seed=11)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=ngram(5))
    reference = plain.generate(ps, greedy(max_tokens=30), use_tqdm=False)
    stops = [r.outputs[0].text[len(r.outputs[0].text) // 2 :][:3] for r in reference]  # text from mid-output
    params = [greedy(max_tokens=30, stop=[s]) if s.strip() else greedy(max_tokens=30) for s in stops]
    got = spec.generate(ps, params, use_tqdm=False)
    want = plain.generate(ps, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        a, b = g.outputs[0], w.outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and x.rank == y.rank and abs(x.logprob - y.logprob) < 1e-4
    assert spec.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_requests_that_cannot_be_verified_ahead_decode_one_token_a_step(llama, plain):
    """Penalties make a position's logits depend on the tokens sampled before it in the same step: such
    requests take no drafts, and their outputs stay what they are."""
    ps = repetitive_prompts(4, seed=5)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=ngram(3))
    params = greedy(repetition_penalty=1.3)
    got = spec.generate(ps, params, use_tqdm=False)
    assert spec.stats().spec_decode_num_drafts == 0
    want = plain.generate(ps, params, use_tqdm=False)
    assert all(same_up_to_near_tie(a, b) for a, b in zip(got, want, strict=True))
    assert_no_leaks(spec)


def test_the_adaptive_rule_keeps_outputs_and_counts(llama, plain):
    """With the measured rule on (the default), whatever it decides, the outputs are those without
    speculation and nothing leaks."""
    ps = repetitive_prompts(8, seed=13)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=ngram(4, adaptive=True))
    got = spec.generate(ps, greedy(), use_tqdm=False)
    want = plain.generate(ps, greedy(), use_tqdm=False)
    assert all(same_up_to_near_tie(a, b) for a, b in zip(got, want, strict=True))
    s = spec.stats()
    assert s.spec_decode_num_accepted_tokens <= s.spec_decode_num_draft_tokens
    assert_no_leaks(spec)


def test_the_server_streams_speculative_steps_as_it_answers_whole(tiny_model_dir):
    """Several tokens a step reach the client as one token's text and logprobs at a time: the stream
    adds up to the whole answer, token for token, and every block comes back."""
    from tests.server.test_server import stream_events
    from tests.server_harness import start_server

    srv = start_server(str(tiny_model_dir("llama")), speculative_config=json.dumps(ngram(4)))
    try:
        prompts = repetitive_prompts(4, seed=2)  # (ones whose continuations this model repeats)
        body = {"model": "tiny", "prompt": prompts, "max_tokens": 40, "temperature": 0}
        body |= {"ignore_eos": True, "logprobs": 2}
        whole = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30.0).json()["choices"]
        text = [""] * 4
        tokens: list[list[str]] = [[] for _ in range(4)]
        logprobs: list[list[float]] = [[] for _ in range(4)]
        for event in stream_events(srv, "/v1/completions", {**body, "stream": True}):
            for choice in event["choices"]:
                i = choice["index"]
                text[i] += choice["text"]
                if choice["logprobs"] is not None:
                    tokens[i] += choice["logprobs"]["tokens"]
                    logprobs[i] += choice["logprobs"]["token_logprobs"]
        for i, w in enumerate(sorted(whole, key=lambda c: c["index"])):
            assert text[i] == w["text"] and tokens[i] == w["logprobs"]["tokens"] and len(tokens[i]) == 40
            assert logprobs[i] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-5)
        stats = srv.wait_all_free()
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.spec_decode_num_accepted_tokens > 0  # some steps did bring several tokens
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- a draft model


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A tiny llama with the target's vocabulary and other weights: its guesses are mostly wrong."""
    from tokenmill.tools.make_model import make_model

    return str(make_model("llama", "tiny", tmp_path_factory.mktemp("draft"), seed=2))


def draft_config(folder: str, k: int = 4) -> dict[str, object]:
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k, "adaptive": False}


def test_a_draft_model_keeps_the_outputs_under_preemption(llama, plain, other_draft):
    """The target as its own draft (every guess kept: several tokens a step, every step) and a draft
    with other weights (guesses mostly rejected): both give the outputs without speculation, with the
    draft's KV in the same blocks through chunked prompts and preemption, and free every block."""
    ps = repetitive_prompts(24, seed=21)
    reference = plain.generate(ps, greedy(), use_tqdm=False)
    for folder in (llama, other_draft):
        tight = LLM(
            llama,
            max_num_seqs=16,
            max_num_batched_tokens=40,
            kv_cache_memory=26 * 24576,  # (13 blocks: each holds the draft's KV beside the target's)
            max_model_len=128,
            speculative_config=draft_config(folder),
        )
        out = tight.generate(ps, greedy(), use_tqdm=False)
        assert all(same_up_to_near_tie(a, b) for a, b in zip(out, reference, strict=True))
        s = tight.stats()
        assert s.preemptions > 0 and s.spec_decode_num_drafts > 0
        if folder == llama:  # its own draft: the target keeps every guess (up to a near tie)
            assert s.spec_decode_num_accepted_tokens >= 0.95 * s.spec_decode_num_draft_tokens
        else:
            assert s.spec_decode_num_accepted_tokens < 0.5 * s.spec_decode_num_draft_tokens
        assert_no_leaks(tight)


def test_seeded_sampling_with_a_draft_model_is_the_same_sample(llama, plain):
    ps = repetitive_prompts(6, seed=23)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=draft_config(llama, 3))
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in range(6)]
    got = spec.generate(ps, params, use_tqdm=False)
    want = plain.generate(ps, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    # the target as its own draft, sampling from the noise the target samples with: every guess kept
    s = spec.stats()
    assert s.spec_decode_num_draft_tokens > 0
    assert s.spec_decode_num_accepted_tokens >= 0.95 * s.spec_decode_num_draft_tokens
    assert_no_leaks(spec)


def test_unseeded_sampling_verifies_a_draft_equal_to_the_target_by_keeping_it(llama):
    """Rejection sampling keeps a draft with probability min(1, p / q): the target as its own draft
    (q = p) keeps every guess, sampling with top-k and min-p."""
    ps = repetitive_prompts(6, seed=27)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=draft_config(llama, 3))
    params = SamplingParams(temperature=0.9, top_k=40, min_p=0.02, max_tokens=24, ignore_eos=True)
    out = spec.generate(ps, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    s = spec.stats()
    assert s.spec_decode_num_draft_tokens > 0
    assert s.spec_decode_num_accepted_tokens >= 0.95 * s.spec_decode_num_draft_tokens
    assert_no_leaks(spec)


def test_a_bad_draft_model_is_refused_naming_it(llama, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's folder, required with method"):
        LLM(llama, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model: "):
        LLM(llama, max_model_len=128, speculative_config=draft_config(str(tmp_path / "missing")))


def test_a_draft_idle_for_a_while_catches_up_before_it_guesses_again(llama, plain):
    """While the rule has the draft idle it runs nothing; its first guesses after come from a KV it
    caught up first: the target as its own draft still keeps (nearly) every guess."""
    ps = repetitive_prompts(6, seed=29)
    spec = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, speculative_config=draft_config(llama, 3))
    drafts = spec.engine.core.scheduler.drafts
    assert isinstance(drafts, Drafting)
    choose, steps = drafts.choose, itertools.count()

    def on_and_off(*args: object) -> bool:
        choose(*args)  # type: ignore[arg-type]
        return next(steps) % 4 < 2  # two steps guessing, two idle (SchedulerOutput.draft_next)

    drafts.choose = on_and_off  # type: ignore[method-assign]
    got = spec.generate(ps, greedy(), use_tqdm=False)
    want = plain.generate(ps, greedy(), use_tqdm=False)
    assert all(same_up_to_near_tie(a, b) for a, b in zip(got, want, strict=True))
    s = spec.stats()
    assert s.spec_decode_num_drafts > 0
    assert s.spec_decode_num_accepted_tokens >= 0.95 * s.spec_decode_num_draft_tokens
    assert_no_leaks(spec)
