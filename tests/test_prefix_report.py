"""`tokenmill prefix-report`: hit rates from the hasher alone, and the divergence that explains a miss."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import main
from tokenmill.doctor.prefix_report import analyse, read_trace
from tokenmill.engine.tokenizer import Tokenizer

SYSTEM = "You are a careful assistant. Answer in one short paragraph, cite sources, and never guess. " * 3


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
    broken = analyse(read_trace(bad, tok), 16, None, tok)
    assert healthy.achievable_hit_rate > 0.5
    assert broken.achievable_hit_rate < 0.05
    top = broken.divergences[0]
    assert top.count >= 5 and top.position < 16  # most prompts split at the changing minute
    assert "12:" in top.before + top.after and any(c.isdigit() for c in top.after)
    assert any("timestamp" in n for n in broken.notes)
    assert main(["prefix-report", str(bad), "--tokenizer", str(folder), "--cache-blocks", "8"]) == 0
    printed = capsys.readouterr().out
    assert "achievable hit rate (unbounded cache): " in printed and "diverge early" in printed


def test_short_shared_prefix_and_lru_size(tmp_path):
    trace = tmp_path / "ids.jsonl"
    write_trace(trace, [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, i, 9, 10]} for i in range(20, 30)])
    report = analyse(read_trace(trace, None), block_size=16)
    assert report.achievable_hit_tokens == 0
    assert any("shorter than one block" in n for n in report.notes)
    shared = [[*range(64), 1000 + i] for i in range(6)]  # 4 shared blocks, then one distinct token
    full = analyse([(p, None) for p in shared], block_size=16)
    assert full.achievable_hit_tokens == 5 * 64
    tiny_cache = analyse([(p, None) for p in shared], block_size=16, cache_blocks=2)
    assert tiny_cache.lru_hit_tokens < full.achievable_hit_tokens
    salted = analyse([(p, f"tenant-{i}") for i, p in enumerate(shared)], block_size=16)
    assert salted.achievable_hit_tokens == 0


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
