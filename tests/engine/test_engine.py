"""The engine end to end on tiny checkpoints: batched = alone = transformers, under chunked prefill and
preemption; prompt logprobs; seeded sampling; stop strings; static batching; no leaked KV blocks."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import OutputKind, RequestOutput

MAX_NEW = 20
TOP = 5


def prompts(count: int, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(3, 70))] for _ in range(count)]


def same_up_to_near_tie(x: RequestOutput, y: RequestOutput) -> bool:
    """Two runs' greedy outputs are equal, or diverge only at a near tie (see tests.helpers)."""
    cx, cy = x.outputs[0], y.outputs[0]
    return assert_same_up_to_near_tie(cx.token_ids, top_logprobs(cx.logprobs), cy.token_ids, top_logprobs(cy.logprobs))


def assert_no_leaks(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.running == 0 and stats.waiting == 0


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def greedy(logprobs: int | None = TOP, **kw: object) -> SamplingParams:
    fields: dict[str, object] = {"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True, "logprobs": logprobs}
    return SamplingParams(**(fields | kw))  # type: ignore[arg-type]


def test_batched_with_chunking_and_preemption_equals_alone_and_transformers(llama):
    import transformers

    ps = prompts(32)
    # ~13 blocks of 16 tokens for up to 16 sequences of up to 90 tokens: preemption is certain
    tight = LLM(llama, max_num_seqs=16, max_num_batched_tokens=40, kv_cache_memory=13 * 24576, max_model_len=128)
    batched = tight.generate(ps, greedy(), use_tqdm=False)
    assert tight.stats().preemptions > 0
    assert_no_leaks(tight)

    alone_llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    alone = [alone_llm.generate([p], greedy(), use_tqdm=False)[0] for p in ps]
    assert_no_leaks(alone_llm)

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    batched_exact = hf_exact = 0
    for p, b, a in zip(ps, batched, alone, strict=True):
        assert b.prompt_token_ids == p
        assert len(b.outputs[0].token_ids) == MAX_NEW and b.outputs[0].finish_reason == "length"
        batched_exact += same_up_to_near_tie(b, a)
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
        hf_tokens = gen.sequences[0, len(p) :].tolist()
        hf_top = []
        for scores in gen.scores:
            top = torch.log_softmax(scores[0].float(), dim=-1).topk(TOP)
            hf_top.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        a_out = a.outputs[0]
        hf_exact += assert_same_up_to_near_tie(a_out.token_ids, top_logprobs(a_out.logprobs), hf_tokens, hf_top)
    # float32 on the CPU: batched (chunked, preempted) runs equal lone runs token for token today;
    # a near tie may break either way against transformers' kernels, but rarely.
    assert batched_exact == len(ps), f"only {batched_exact} of {len(ps)} batched outputs equal the lone runs"
    assert hf_exact >= len(ps) - 2, f"only {hf_exact} of {len(ps)} equal transformers exactly"


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(llama, hf_logits, tiny_model_dir):
    ps = prompts(3, seed=1)
    llm = LLM(llama, max_num_batched_tokens=16, max_model_len=128, kv_cache_memory=64 * 24576)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for p, out in zip(ps, outs, strict=True):
        ref = torch.log_softmax(hf_logits(tiny_model_dir("llama"), torch.tensor(p)), dim=-1)
        rows = out.prompt_logprobs
        assert rows is not None and len(rows) == len(p) and rows[0] is None
        for j in range(1, len(p)):
            row = rows[j]
            assert row is not None and row.token_id == p[j]
            assert abs(row.logprob - ref[j - 1, p[j]].item()) <= 1e-4
            top = ref[j - 1].topk(3)
            assert [t for t, _ in row.top] == top.indices.tolist()
            assert row.rank == int((ref[j - 1] > ref[j - 1, p[j]]).sum()) + 1
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llama):
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, max_num_batched_tokens=24)
    target = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts(6, seed=6)
    mixed = llm.generate(
        [*others[:3], target, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 3 + [params] + [SamplingParams(temperature=0.5)] * 3,
        use_tqdm=False,
    )
    assert alone == again == mixed[3].outputs[0].token_ids
    other_seed = llm.generate([target], SamplingParams(temperature=0.9, seed=99, max_tokens=16), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    assert_no_leaks(llm)


def test_n_children_share_the_prompt_and_differ(llama):
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    out = llm.generate([prompts(1, seed=7)[0]], SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True), False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate([prompts(1, seed=7)[0]], SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True), False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leaks(llm)


def test_stop_string_across_tokens_is_left_out(llama):
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    p = prompts(1, seed=8)[0]
    full = llm.generate([p], greedy(logprobs=None, max_tokens=16), use_tqdm=False)[0].outputs[0]
    tok = llm.engine.tokenizer
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # a stop string that starts inside one token's text and ends inside a later one
    cut = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) > len(pieces[i - 2]) + 1)
    start = len(pieces[cut - 1]) - 1
    stop = full.text[start : start + 2]
    assert len(stop) == 2 and stop not in full.text[:start]
    out = llm.generate([p], greedy(logprobs=None, max_tokens=16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_no_leaks(llm)


def test_eos_ends_a_request_and_text_is_the_decoded_tokens(llama):
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    outs = llm.generate(prompts(8, seed=9), SamplingParams(temperature=1.0, seed=3, max_tokens=40), use_tqdm=False)
    tok = llm.engine.tokenizer
    for out in outs:
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in tok.info.eos_token_ids
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_no_leaks(llm)


def test_static_batching_gives_the_same_greedy_outputs(llama):
    ps = prompts(10, seed=10)
    cont = LLM(llama, max_num_seqs=4, max_model_len=128, kv_cache_memory=64 * 24576)
    stat = LLM(llama, max_num_seqs=4, max_model_len=128, kv_cache_memory=64 * 24576, scheduling="static")
    a = cont.generate(ps, greedy(), use_tqdm=False)
    b = stat.generate(ps, greedy(), use_tqdm=False)
    exact = sum(same_up_to_near_tie(x, y) for x, y in zip(a, b, strict=True))
    assert exact == len(ps), f"only {exact} of {len(ps)} static outputs equal the continuous ones"
    assert_no_leaks(cont)
    assert_no_leaks(stat)


def test_bad_requests_are_refused_and_leave_nothing_behind(llama):
    llm = LLM(llama, max_model_len=64, kv_cache_memory=64 * 24576)
    with pytest.raises(ValueError, match="prompt: 70 tokens leave no room"):
        llm.generate([[5] * 10, [5] * 70], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_tokens: prompt \(10 tokens\) \+ max_tokens \(60\) exceeds"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=60), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt: token ids must be integers in \[0, 4096\)"):
        llm.generate([[5, 4096]], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: 2 given for 1 prompts"):
        llm.generate(["hello"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature: expected a number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="kv_cache_memory: 24576 bytes hold 16 tokens"):
        LLM(llama, kv_cache_memory=24576, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompts\[1\]: a prompt dict holds exactly one of prompt, prompt_token_ids"):
        llm.generate([[5] * 4, {"prompt_ids": [5] * 4}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 'prompt_token_ids' must be a list of token ids"):
        llm.generate([{"prompt_token_ids": "5 6 7"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: must be a string, a list of token ids or a prompt dict"):
        llm.generate([[5, 6.5]], use_tqdm=False)
    llm.engine.add_request("twice", [5] * 3, SamplingParams(max_tokens=2))  # (the scheduler only asserts this)
    with pytest.raises(ValueError, match="request_id: 'twice' is already in use"):
        llm.engine.add_request("twice", [5] * 3, SamplingParams(max_tokens=2))
    assert llm.engine.abort_request("twice")
    assert_no_leaks(llm)
    out = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) <= 3
    assert_no_leaks(llm)


def test_prompt_dicts_are_the_prompts_they_hold(llama):
    """vLLM's TextPrompt and TokensPrompt shapes: {"prompt": text} and {"prompt_token_ids": ids}."""
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    ids = prompts(1)[0]
    params = SamplingParams(max_tokens=6, temperature=0)
    plain = llm.generate([ids, "hello world"], params, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": "hello world"}], params, use_tqdm=False)
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in dicts] == [o.prompt_token_ids for o in plain]
    assert dicts[0].prompt_token_ids == ids
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_stats_count_tokens_and_blocks(llama):
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576, max_num_batched_tokens=32)
    ps = prompts(5, seed=11)
    outs = llm.generate(ps, greedy(logprobs=None, max_tokens=6), use_tqdm=False)
    stats = llm.stats()
    assert stats.prompt_tokens == sum(len(p) for p in ps)
    assert stats.generated_tokens == sum(len(o.outputs[0].token_ids) for o in outs) == 30
    assert stats.kv_blocks_total == 64 and stats.preemptions == 0
    assert_no_leaks(llm)


def test_cli_generate_streams_the_greedy_text(llama, capsys):
    from tokenmill.cli import main

    text = "def main():\n    return"
    assert main(["generate", llama, "--prompt", text, "--max-tokens", "8", "--temperature", "0", "--ignore-eos"]) == 0
    printed = capsys.readouterr()
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    expected = llm.generate(text, greedy(logprobs=None, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert printed.out == expected + "\n"
    assert "[finish_reason: length]" in printed.err
    assert main(["generate", llama, "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature: expected a number >= 0" in capsys.readouterr().err


def test_seeded_sampling_survives_preemption_and_recompute(llama):
    ps = prompts(16, seed=12)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True) for i in range(16)
    ]
    tight = LLM(llama, max_num_seqs=16, max_num_batched_tokens=40, kv_cache_memory=11 * 24576, max_model_len=128)
    batched = tight.generate(ps, params, use_tqdm=False)
    assert tight.stats().preemptions > 0
    assert_no_leaks(tight)
    roomy = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    for p, param, out in zip(ps, params, batched, strict=True):
        alone = roomy.generate([p], param, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_delta_outputs_send_tokens_and_logprobs_with_their_text(llama):
    """Streaming deltas: at every output, the tokens (and logprobs) sent so far decode to a prefix of
    the text sent so far — a token whose text is partly held back (a possible stop string) waits for
    the rest of it; at the end both are whole."""
    llm = LLM(llama, max_model_len=128, kv_cache_memory=64 * 24576)
    engine, tok = llm.engine, llm.engine.tokenizer
    p = prompts(1, seed=13)[0]
    full = llm.generate([p], greedy(logprobs=None, max_tokens=24), use_tqdm=False)[0].outputs[0]
    # stop strings that begin like the output's text at several points, so that text is held back
    starts = [full.text[i : i + 1] + "\x00" for i in range(0, len(full.text), 3)]
    engine.add_request("d", p, greedy(logprobs=2, max_tokens=24, n=2, stop=starts), output_kind=OutputKind.DELTA)
    sent: dict[int, tuple[str, list[int], int]] = {0: ("", [], 0), 1: ("", [], 0)}
    outputs = held_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs += 1
            for c in out.outputs:
                text, ids, n_lp = sent[c.index]
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
                text, ids, n_lp = text + c.text, ids + c.token_ids, n_lp + len(c.logprobs)
                sent[c.index] = (text, ids, n_lp)
                assert n_lp == len(ids) and text.startswith(tok.decode(ids))
                held_tokens += tok.decode(ids) != text
    for text, ids, _ in sent.values():
        assert text == full.text and ids == full.token_ids
    assert 1 < outputs < 2 * 24  # several deltas, and none carries nothing
    assert held_tokens > 0  # some token waited for its held-back text
    assert_no_leaks(llm)
