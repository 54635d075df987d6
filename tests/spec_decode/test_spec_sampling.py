"""Speculative decoding keeps the target's distribution: unseeded sampling with a draft model that
differs from the target, verified by rejection sampling, draws the first three tokens from exactly the
target's distribution, enumerated over a 32-token vocabulary with transformers as the reference
(chi-square over >= 20,000 samples, low-count bins merged), with and without top-k / top-p; the same
test with a deliberately wrong rule (a refused draft's position drawn from p instead of the residual
max(0, p - q)) fails, so the test can tell. The rule alone is checked exactly on small distributions."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import assert_no_leaks
from tokenmill import LLM, SamplingParams
from tokenmill.models.train_tokenizer import SpecialTokens, save_tokenizer
from tokenmill.spec_decode.rejection import RejectionSampler, Verification

VOCAB = 32
PROMPT = [0, 7, 12, 9, 21, 5, 30, 18]
SAMPLES = 20_000


def small_vocab_model(out: Path, seed: int, noise: float = 0.0) -> Path:
    """A random llama over a 32-token vocabulary (5 specials, 26 letters, a space) with a tokenizer
    to match; a large init scale makes its next-token distributions far from uniform. `noise`: each
    weight matrix gets Gaussian noise of this many times its own spread (a draft close to, but not
    the same as, the model of the same seed)."""
    import transformers
    from tokenizers import Tokenizer, models

    specials = SpecialTokens()
    letters = [chr(ord("a") + i) for i in range(26)] + [" "]
    vocab = {token: i for i, token in enumerate(specials.all() + letters)}
    assert len(vocab) == VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.add_special_tokens(specials.all())
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.add_(torch.randn_like(weight) * weight.std() * noise)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    save_tokenizer(tokenizer, out, specials, 64)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vocab32")
    return small_vocab_model(root / "target", seed=3), small_vocab_model(root / "draft", seed=3, noise=0.06)


def exact_distribution(folder: Path, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """[32 ** 3]: transformers' probability of each first three tokens after PROMPT (index
    t1 * 1024 + t2 * 32 + t3), with its own temperature, top-k and top-p warpers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(transformers.TopPLogitsWarper(top_p))

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [N, L] -> [N, 32]
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1].double()
        for warp in warpers:
            logits = warp(prefixes, logits)
        return logits.softmax(dim=-1)

    prompt = torch.tensor(PROMPT)
    tokens = torch.arange(VOCAB)
    p1 = next_probs(prompt[None])[0]  # [32]
    firsts = torch.cat([prompt.expand(VOCAB, -1), tokens[:, None]], dim=1)  # [32, L + 1]
    p2 = next_probs(firsts)  # [32, 32]
    seconds = torch.cat([firsts.repeat_interleave(VOCAB, 0), tokens.repeat(VOCAB)[:, None]], dim=1)  # [1024, L + 2]
    p3 = next_probs(seconds)  # [1024, 32]
    return (p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)).flatten()


def chi_square_p(counts: collections.Counter[int], probs: torch.Tensor, n: int) -> float:
    """p-value of the observed counts under `probs`: bins expected below 5 merged into one."""
    expected = probs * n
    big = expected >= 5
    observed = torch.zeros_like(probs)
    for index, count in counts.items():
        observed[index] = count
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def sample_first_three(target: Path, draft: Path, params: SamplingParams) -> tuple[collections.Counter[int], LLM]:
    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        speculative_config={
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
    )
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * SAMPLES, params, use_tqdm=False)
    counts: collections.Counter[int] = collections.Counter()
    for o in outputs:
        t1, t2, t3 = o.outputs[0].token_ids[:3]
        counts[t1 * VOCAB * VOCAB + t2 * VOCAB + t3] += 1
    return counts, llm


CASES = {"plain": (1.0, None, 1.0), "top-k/top-p": (0.8, 12, 0.9)}


# ~15 s a case: `make test-all` runs them; the default run keeps the rule alone (below) and the greedy
# equalities (test_spec_decode.py)
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_unseeded_sampling_with_a_draft_model_follows_the_targets_distribution(pair, case):
    """max_tokens 4: after the first token the draft guesses two, so the first three tokens come from
    drafts kept, drafts refused (the residual) and bonus tokens."""
    temperature, top_k, top_p = CASES[case]
    target, draft = pair
    exact = exact_distribution(target, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4, ignore_eos=True)
    counts, llm = sample_first_three(target, draft, params)
    s = llm.stats()
    assert 0.2 < s.spec_decode_acceptance_rate < 0.9  # drafts both kept and refused, many times
    assert s.spec_decode_num_draft_tokens > SAMPLES
    assert_no_leaks(llm)
    assert chi_square_p(counts, exact, SAMPLES) > 0.001


@pytest.mark.slow  # the distribution test's power, not the engine's behaviour (the tests above check that)
def test_a_wrong_acceptance_rule_fails_the_distribution_test(pair, monkeypatch):
    """Drawing a refused draft's position from p itself (not from max(0, p - q)) favours the tokens
    the draft proposes: the test above sees it."""
    target, draft = pair
    monkeypatch.setattr(RejectionSampler, "residual", lambda self, p, q: p)
    exact = exact_distribution(target, 1.0, None, 1.0)
    counts, _ = sample_first_three(target, draft, SamplingParams(max_tokens=4, ignore_eos=True))
    assert chi_square_p(counts, exact, SAMPLES) < 0.001


def rule_distribution(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], trials: int) -> torch.Tensor:
    """The first token the rule yields for one draft `drafts[0]` (q: its distribution, or None: a point
    mass), as frequencies over `trials` seeds."""
    sampler = RejectionSampler()
    counts = torch.zeros(p.shape[1], dtype=torch.float64)
    own = torch.zeros(p.shape[0], dtype=torch.int64)  # the bonus row's token: not counted here
    for seed in range(trials):
        out = sampler.resample(p, own, [Verification(0, drafts, q, seed, 0)])
        counts[out[0]] += 1
    return counts / trials


def test_the_rule_alone_gives_p_for_a_sampled_draft_and_for_a_point_mass():
    """One draft position over a 4-token vocabulary: averaged over the draft's own distribution q (each
    draft token weighted by q), and for a point-mass draft, the token kept or drawn has distribution p."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    mixed = sum(q[0, d] * rule_distribution(p, q, [d], 4000) for d in range(4))
    assert torch.allclose(mixed.float(), p[0], atol=0.03)
    for d in range(3):
        assert torch.allclose(rule_distribution(p, None, [d], 4000).float(), p[0], atol=0.03)
    # a draft the target rules out (p = 0) is never kept
    assert rule_distribution(p, None, [3], 500)[3] == 0
