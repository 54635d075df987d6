"""`tokenmill prefix-report`: hit rates from the hasher and the engine's KV manager, equal to the
engine's own, and the divergence that explains a miss."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.doctor.prefix_report import TraceRequest, analyse, common_prefix, read_trace
from tokenmill.text.tokenizer import Tokenizer

SYSTEM = "You are a careful assistant. Answer in one short paragraph, cite sources, and never guess. " * 3
BLOCK_BYTES = 24576  # one 16-token KV block of the tiny llama, float32


def write_trace(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_planted_timestamp_is_found(tiny_model_dir, tmp_path, capsys):
    folder = tiny_model_dir("llama")
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    questions = [f"Question {i}: what is {i} squared?" for i in range(12)]
    write_trace(good, [{"prompt": SYSTEM + q} for q in questions])
    write_trace(bad, [{"prompt": f"Now: 2026-11-30 12:{i:02d}:07. " + SYSTEM + q} for i, q in enumerate(questions)])
    tok = Tokenizer(folder)
    healthy = analyse(read_trace(good, tok), 16, None, tok)
    requests = read_trace(bad, tok)
    broken = analyse(requests, 16, None, tok)
    assert healthy.achievable_hit_rate > 0.5
    assert broken.achievable_hit_rate < 0.05
    # Where the minute starts, from the tokenizer: prompts 0 and 1 (minutes 00 and 01) agree up to there.
    minute = common_prefix(requests[0].token_ids, requests[1].token_ids)
    assert tok.decode(requests[0].token_ids[:minute], skip_special_tokens=False).endswith("12:")
    assert 0 < minute < 16
    ids = [r.token_ids for r in requests]
    splits = [max(common_prefix(ids[i], earlier) for earlier in ids[:i]) for i in range(1, len(ids))]
    assert splits.count(minute) >= 5  # most split at the minute; the rest ('0', '4' in two tokens) a token on
    top = broken.divergences[0]
    assert (top.position, top.count) == (minute, splits.count(minute))
    assert top.before.endswith("12:") and top.after.startswith("01")  # quoted from prompt 1, the first to split
    early = [n for n in broken.notes if n.startswith("prompts diverge early")]
    assert early == [early[0]] and f"(token {minute})" in early[0]
    assert main(["prefix-report", str(bad), "--tokenizer", str(folder), "--cache-blocks", "16"]) == 0
    printed = capsys.readouterr().out
    assert (
        "achievable hit rate (unbounded cache): 0.0%" in printed
        and "16 blocks (LRU, one request at a time): 0.0%" in printed
    )
    assert (
        f"  token {minute} ({top.count} prompts): ...'" in printed
        and f"prompts diverge early (token {minute})" in printed
    )


def test_short_shared_prefix_and_lru_size(tmp_path):
    trace = tmp_path / "ids.jsonl"
    write_trace(trace, [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, i, 9, 10]} for i in range(20, 30)])
    report = analyse(read_trace(trace, None), block_size=16)
    assert report.achievable_hit_tokens == 0
    assert any("shorter than one block" in n for n in report.notes)
    shared = [[*range(64), 1000 + i] for i in range(6)]  # 4 shared blocks, then one distinct token
    full = analyse([(p, None) for p in shared], block_size=16)
    assert full.achievable_hit_tokens == 5 * 64
    # 65 tokens + 1 output need 5 blocks: a 5-block cache holds the 4 shared ones across requests.
    fits = analyse([(p, None) for p in shared], block_size=16, cache_blocks=5)
    assert fits.lru_hit_tokens == full.achievable_hit_tokens and fits.skipped_requests == 0
    # A 2-block KV cache cannot hold one such request: the engine refuses them all.
    tiny_cache = analyse([(p, None) for p in shared], block_size=16, cache_blocks=2)
    assert tiny_cache.lru_hit_tokens == 0 and tiny_cache.skipped_requests == 6
    assert any(n.startswith("6 of 6 requests need more KV blocks") for n in tiny_cache.notes)
    # Outputs take blocks too: the engine admits a request if prompt + max_tokens fit (65 + 15 do in 5 blocks).
    assert analyse([(p, None) for p in shared], 16, 5, max_tokens=15).lru_hit_tokens == 5 * 64
    assert analyse([(p, None) for p in shared], 16, 5, max_tokens=16).skipped_requests == 6
    salted = analyse([(p, f"tenant-{i}") for i, p in enumerate(shared)], block_size=16, cache_blocks=64)
    assert salted.achievable_hit_tokens == salted.lru_hit_tokens == 0


def test_lru_evicts_a_finished_chain_from_its_tail(tmp_path):
    """A, B, A, B, A with two 50-token prompts that share nothing: each takes 4 blocks (3 full, one
    partial) and frees them tail first, so the next one evicts the other's partial block, then its
    last full block, and its head survives. With 5 blocks a repeat keeps 1 block (16 tokens), with 6
    it keeps 2, with 7 all 3: what the engine serves (test_report_equals_the_engine). An LRU over
    hashes that evicts a prompt's head first gives 0, 144 and 144."""
    rng = random.Random(0)
    a, b = ([rng.randrange(5, 4096) for _ in range(50)] for _ in range(2))
    trace = tmp_path / "abab.jsonl"
    write_trace(trace, [{"prompt_token_ids": p} for p in (a, b, a, b, a)])
    requests = read_trace(trace, None)
    assert [analyse(requests, 16, n).lru_hit_tokens for n in (4, 5, 6, 7, 64)] == [0, 48, 96, 144, 144]
    assert analyse(requests, 16, 64).achievable_hit_tokens == 144


def run_on_engine(llm: LLM, requests: list[TraceRequest]) -> tuple[int, int]:
    """(sum of num_cached_tokens, requests refused) with the requests served one at a time."""
    engine = llm.engine
    cached = refused = 0
    for n, request in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            engine.add_request(f"r{n}", request.token_ids, params, cache_salt=request.cache_salt)
        except ValueError as e:
            assert "KV blocks" in str(e) or "maximum model length" in str(e)
            refused += 1
            continue
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        assert len(finished) == 1 and len(finished[0].outputs[0].token_ids) == request.max_tokens
        cached += finished[0].num_cached_tokens
    return cached, refused


def exactness_trace() -> list[TraceRequest]:
    rng = random.Random(7)
    systems = [[rng.randrange(5, 4096) for _ in range(n)] for n in (20, 37, 64)]
    a, b = ([rng.randrange(5, 4096) for _ in range(50)] for _ in range(2))
    # Two blocks, then again with a decode step: the block it recomputes (only one of the two may be
    # adopted) is not cached again (the first copy holds its hash) and its decode step, with 3 blocks,
    # evicts that first copy; so the third, a block longer, hits one block, not two.
    short = systems[2][:32]
    out = [TraceRequest(short, None, 1), TraceRequest(short, None, 2), TraceRequest(short + [5] * 10, None, 1)]
    out += [TraceRequest(p, None, 1) for p in (a, b, a, b, a)]  # the A, B, A, B, A trace
    for i in range(26):
        prompt = systems[rng.randrange(3)] + [rng.randrange(5, 4096) for _ in range(rng.randint(1, 40))]
        out.append(TraceRequest(prompt, None, rng.choice((1, 2, 5, 16, 17, 30))))
        if i % 5 == 2:  # the same prompt again, with another output length
            out.append(TraceRequest(list(prompt), None, rng.randint(1, 20)))
    out.append(TraceRequest(systems[2][:48], None, 3))  # exactly 3 blocks: at most 2 adopted
    out.append(TraceRequest(systems[2][:48], None, 1))
    out.append(TraceRequest(systems[1] + [9] * 11, "tenant-b", 4))  # salted: misses the others' blocks...
    out.append(TraceRequest(systems[1] + [9] * 30, "tenant-b", 2))  # ...and hits its own
    out.append(TraceRequest(systems[0] + [rng.randrange(5, 4096) for _ in range(180)], None, 8))  # needs 13 blocks
    out.append(TraceRequest(systems[1] + [3] * 20, None, 2))
    return out


@pytest.mark.parametrize(
    ("num_blocks", "chunk"), [(3, 512), (5, 512), (6, 512), (8, 512), (12, 512), (12, 24), (64, 512)]
)
def test_report_equals_the_engine(tiny_model_dir, num_blocks, chunk):
    requests = exactness_trace()
    llm = LLM(
        str(tiny_model_dir("llama")),
        kv_cache_memory=num_blocks * BLOCK_BYTES,
        max_model_len=min(num_blocks * 16, 512),
        max_num_batched_tokens=chunk,
    )
    assert llm.engine.core.scheduler.kv.num_blocks == num_blocks
    cached, refused = run_on_engine(llm, requests)
    report = analyse(requests, 16, num_blocks, max_num_batched_tokens=chunk)
    assert (report.lru_hit_tokens, report.skipped_requests) == (cached, refused)
    if num_blocks == 64:
        assert refused == 0 and cached == report.achievable_hit_tokens  # nothing evicted
    else:
        assert refused > 0 and cached < report.achievable_hit_tokens


def test_max_tokens_from_the_trace_and_the_command_line(tmp_path, capsys):
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks and a partial one
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt, "max_tokens": 40}])
    assert [r.max_tokens for r in read_trace(trace, None)] == [None, 40]
    # 50 + 40 tokens need 6 blocks; with 5 the second is refused, whatever --max-tokens says for the first.
    assert main(["prefix-report", str(trace), "--cache-blocks", "5", "--max-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "hit rate with a KV cache of 5 blocks (LRU, one request at a time): 0.0%" in printed
    assert "1 of 2 requests need more KV blocks" in printed
    assert main(["prefix-report", str(trace), "--cache-blocks", "6"]) == 0
    assert "hit rate with a KV cache of 6 blocks (LRU, one request at a time): 48.0%" in capsys.readouterr().out


def test_bad_traces(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="need --tokenizer"):
        read_trace(trace, None)
    trace.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: not valid JSON"):
        read_trace(trace, None)
    trace.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="field 'prompt', 'prompt_token_ids' or 'messages' is missing"):
        read_trace(trace, None)
    for row, message in [
        ({"prompt_token_ids": [1, 2], "max_tokens": 0}, "max_tokens: expected a positive integer"),
        ({"prompt_token_ids": [1, 2], "max_tokens": "8"}, "max_tokens: expected a positive integer"),
        ({"prompt_token_ids": [1, -2]}, "token ids must be non-negative integers"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"prompt_token_ids": [1], "cache_salt": 3}, "cache_salt: expected a string"),
    ]:
        write_trace(trace, [row])
        with pytest.raises(ValueError, match=r"t\.jsonl:1: " + message):
            read_trace(trace, None)
    with pytest.raises(ValueError, match="cache_blocks: expected a positive integer"):
        analyse([([1, 2], None)], 16, 0)
    with pytest.raises(ValueError, match="max_tokens: expected a positive integer"):
        analyse([([1, 2], None)], 16, 4, max_tokens=0)
