"""The doctor's trace readers (tokenmill/doctor/traces/): the public formats parsed from slices of the real
files (tests/doctor/data/README.md says where each came from), windows, time scaling, lengths scaled and
clipped to the model's context, and block ids made into token blocks that share exactly as the ids do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.doctor.prefix_report import TraceRequest, replay_kv_cache
from tokenmill.doctor.traces.load import TraceFlags, load_workload
from tokenmill.doctor.traces.public import read_azure, read_burstgpt, read_mooncake
from tokenmill.doctor.traces.rows import ParsedTrace, TraceRow, Window
from tokenmill.doctor.traces.shape import Shaping, block_reuse, shape

DATA = Path(__file__).parent / "data"
AZURE = DATA / "azure_code_slice.csv"
BURST = DATA / "burstgpt_handwritten.csv"
MOONCAKE = DATA / "mooncake_conversation_slice.jsonl"


def load(name: str, max_model_len: int = 1024, num: int | None = None, **flags):
    return load_workload(WorkloadSpec(name, num), None, max_model_len, 8192, TraceFlags(**flags))


def shared_blocks(a: list, b: list, block: int) -> int:
    """Whole blocks of `block` tokens two prompts share from their start."""
    n = 0
    while (n + 1) * block <= min(len(a), len(b)) and a[n * block : (n + 1) * block] == b[n * block : (n + 1) * block]:
        n += 1
    return n


def shared_ids(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------------------- parsers


def test_azure_rows_are_the_csv_rows_in_seconds_from_the_first():
    lines = AZURE.read_text().splitlines()[1:]
    parsed = read_azure(AZURE, Window(), None)
    assert len(parsed.rows) == len(lines) == 40
    first, second = parsed.rows[0], parsed.rows[1]
    assert (first.arrival_s, first.prompt_len, first.output_len) == (0.0, 4808, 10)  # 18:17:03.9799600,4808,10
    assert second.arrival_s == pytest.approx(0.052, abs=1e-6) and (second.prompt_len, second.output_len) == (3180, 8)
    last = lines[-1].split(",")
    assert parsed.rows[-1].prompt_len == int(last[1]) and parsed.rows[-1].output_len == int(last[2])
    assert parsed.rows[-1].arrival_s == pytest.approx(38.2643990 - 3.9799600, abs=1e-5)  # 18:17:38.2643990
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(parsed.rows, parsed.rows[1:], strict=False))
    assert parsed.block_size is None and all(r.blocks is None for r in parsed.rows)


def test_burstgpt_skips_failed_rows_and_counts_the_models():
    parsed = read_burstgpt(BURST, Window(), None)
    body = [line.split(",") for line in BURST.read_text().splitlines()[1:]]
    ok = [row for row in body if row[3] != "0"]
    assert len(parsed.rows) == len(ok) == 22
    assert [(r.prompt_len, r.output_len) for r in parsed.rows] == [(int(r[2]), int(r[3])) for r in ok]
    assert parsed.rows[1].arrival_s == float(ok[1][0]) - float(body[0][0])
    assert "2 failed requests (0 response tokens) skipped" in parsed.notes
    assert any(n.startswith("models: ChatGPT") for n in parsed.notes)


def test_burstgpt_reads_the_newer_schema_with_session_and_elapsed_time(tmp_path):
    path = tmp_path / "new.csv"
    path.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10.5,,1.2,ChatGPT,100,20,120,API log\n11.0,7,3.0,GPT-4,300,40,340,Conversation log\n"
    )
    rows = read_burstgpt(path, Window(), None).rows
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in rows] == [(0.0, 100, 20), (0.5, 300, 40)]


def test_mooncake_rows_keep_their_hash_ids_and_milliseconds():
    lines = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    parsed = read_mooncake(MOONCAKE, Window(), None)
    assert parsed.block_size == 512 and len(parsed.rows) == len(lines)
    for row, line in zip(parsed.rows, lines, strict=True):
        assert row.blocks == line["hash_ids"] and row.prompt_len == line["input_length"]
        assert row.arrival_s == pytest.approx((line["timestamp"] - lines[0]["timestamp"]) / 1000)


@pytest.mark.parametrize(
    ("reader", "text", "message"),
    [
        (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "line 2: TIMESTAMP must be a date"),
        (read_azure, "TIMESTAMP,Context\n2023-11-16 18:17:03,5\n", "no column ContextTokens, GeneratedTokens"),
        (read_burstgpt, "Timestamp,Request tokens,Response tokens\n1,-4,3\n", "Request tokens must be a whole number"),
        (read_mooncake, '{"timestamp": 0, "input_length": 1200, "output_length": 3, "hash_ids": [1, 2]}\n', "2 ids"),
        (read_mooncake, "not json\n", "line 1: not JSON"),
    ],
)
def test_a_bad_row_names_its_file_line_and_field(tmp_path, reader, text, message):
    path = tmp_path / "bad"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        reader(path, Window(), None)


# ----------------------------------------------------------------------------- windows and scaling


def test_a_window_keeps_the_rows_in_its_span_rebased_and_time_scaled():
    everything = read_azure(AZURE, Window(), None).rows
    inside = [r for r in everything if 1 <= r.arrival_s < 31]
    workload, info = load(f"azure:{AZURE}", window="1:31", time_scale=0.5)
    assert len(workload.requests) == len(inside) > 0
    for request, row in zip(workload.requests, inside, strict=True):
        assert request.arrival_s == pytest.approx((row.arrival_s - 1) * 0.5)
    assert "1 s to 31 s of the trace" in info.notes[0] and "x0.5 (--time-scale)" in info.notes[0]
    assert len(load(f"azure:{AZURE}", num=5)[0].requests) == 5


def test_window_and_scale_flags_are_checked():
    with pytest.raises(ValueError, match="--window: need 0 <= START < END"):
        Window.parse("20:10")
    with pytest.raises(ValueError, match="--time-scale: must be a finite number above 0"):
        load(f"azure:{AZURE}", time_scale=0.0)
    with pytest.raises(ValueError, match="--length-scale: 'big' is not a number or fit"):
        load(f"azure:{AZURE}", length_scale="big")
    with pytest.raises(ValueError, match="no requests in 1000 s to 2000 s"):
        load(f"azure:{AZURE}", window="1000:2000")


def test_a_prompt_longer_than_the_context_is_clipped_never_refused():
    """Azure's code prompts run to thousands of tokens: against a 256-token context every request fits
    (prompt + output <= 256, the output at least what the prompt leaves or a quarter), the head of the
    prompt is what is kept, and the report states the share clipped."""
    rows = read_azure(AZURE, Window(), None).rows
    workload, info = load(f"azure:{AZURE}", max_model_len=256)
    for request, row in zip(workload.requests, rows, strict=True):
        p, o = len(request.prompt_token_ids), request.max_tokens
        assert p + o <= 256 and p >= 1 and o >= 1
        if row.prompt_len + row.output_len <= 256:
            assert (p, o) == (row.prompt_len, row.output_len)
        else:
            assert o == min(row.output_len, max(256 - row.prompt_len, 64))
    clipped = sum(1 for r in rows if r.prompt_len + r.output_len > 256)
    assert info.clipped_share == clipped / len(rows) > 0.5
    assert f"{clipped} of {len(rows)} requests ({clipped / len(rows):.1%})" in info.notes[1]


def test_length_scale_fit_makes_the_99th_percentile_request_fit():
    rows = read_mooncake(MOONCAKE, Window(), None).rows
    workload, info = load(f"mooncake:{MOONCAKE}", max_model_len=1024, length_scale="fit")
    totals = sorted(r.prompt_len + r.output_len for r in rows)
    factor = 1024 / totals[min(len(totals) - 1, int(0.99 * len(totals)))]
    for request, row in zip(workload.requests, rows, strict=True):
        if row is not max(rows, key=lambda r: r.prompt_len + r.output_len):
            assert len(request.prompt_token_ids) == max(1, round(row.prompt_len * factor))
    assert f"x{factor:.4g} (--length-scale fit); a block id covers {round(512 * factor)} tokens" in info.notes[1]


# ----------------------------------------------------------------------------- block ids -> token blocks


def test_token_blocks_share_exactly_as_the_mooncake_ids_do():
    """For every pair of replayed prompts, the whole blocks they share are the ids they share (the
    scaled block of 51 tokens a 512-token id becomes at x0.1), no more, no fewer."""
    rows = read_mooncake(MOONCAKE, Window(), None).rows
    workload, _ = load(f"mooncake:{MOONCAKE}", length_scale="0.1")
    block = round(512 * 0.1)
    prompts = [r.prompt_token_ids for r in workload.requests]
    pairs = 0
    for i in range(len(rows)):
        for j in range(i):
            whole = min(len(prompts[i]), len(prompts[j])) // block
            expect = min(shared_ids(rows[i].blocks, rows[j].blocks), whole)
            assert shared_blocks(prompts[i], prompts[j], block) == expect
            pairs += expect > 1
    assert pairs > 0  # (the slice does share more than the first block somewhere)


def test_the_traces_own_block_reuse_is_counted_on_whole_prefix_blocks():
    rows = [
        TraceRow(0.0, 1024, 1, blocks=["a", "b"]),
        TraceRow(1.0, 1100, 1, blocks=["a", "b", "c", "d"]),  # 2 whole blocks seen: 1024 tokens
        TraceRow(2.0, 600, 1, blocks=["x", "b"]),  # "b" was seen, but after a new first block: nothing
        TraceRow(3.0, 300, 1, blocks=["a"]),  # a partial block never counts
    ]
    assert block_reuse(rows, 512) == 1024 / (1024 + 1100 + 600 + 300)
    workload, info = shape(ParsedTrace("mooncake:x", rows, 512), Shaping(4096, 100))
    assert info.trace_reuse == pytest.approx(1024 / 3024)
    assert workload.requests[1].prompt_token_ids[:1024] == workload.requests[0].prompt_token_ids
    assert workload.requests[2].prompt_token_ids[512:600] == workload.requests[0].prompt_token_ids[512:600]
    assert workload.requests[3].prompt_token_ids == workload.requests[0].prompt_token_ids[:300]
    assert all(3 <= t < 100 for r in workload.requests for t in r.prompt_token_ids)


def test_a_hash_block_scaled_below_a_kv_block_is_warned_of_with_its_numbers():
    """Ids of 512 tokens scaled x1/64 cover 8 tokens: a 16-token KV block spans two ids, so a shared first id
    is never a whole KV block and the replay finds no reuse; 8-token KV blocks (what the warning says) find it."""
    rows = [TraceRow(float(i), 1536, 1, blocks=["a", f"b{i}", f"c{i}"]) for i in range(6)]
    workload, info = shape(ParsedTrace("mooncake:x", rows, 512), Shaping(4096, 100, length_scale=1 / 64))
    trace = [TraceRequest(r.prompt_token_ids, None, r.max_tokens) for r in workload.requests]
    assert replay_kv_cache(trace, 16, 1000)[0] == 0  # (the first id's 8 tokens: half a KV block)
    assert replay_kv_cache(trace, 8, 1000)[0] == 5 * 8  # (every request after the first: its first id)
    warning = info.block_warning(16, 0.0)
    assert warning is not None
    assert "512-token hash block is 8 tokens after --length-scale x0.01562" in warning
    assert "smaller than a KV block (16 tokens)" in warning
    assert f"0.0% of prompt tokens replayed from the cache against the trace's own {info.trace_reuse:.1%}" in warning
    assert "--block-size 8 or less" in warning and "--length-scale 0.03125 or more" in warning
    assert info.block_warning(8, 0.2) is None  # a KV block within a block id: nothing to warn of
    _, unscaled = shape(ParsedTrace("mooncake:x", rows, 512), Shaping(4096, 100, length_scale=1 / 16))
    assert unscaled.block_tokens == 32 and unscaled.block_warning(16, 0.3) is None


def test_prompts_without_ids_share_nothing(tmp_path):
    workload, info = load(f"burstgpt:{BURST}")
    prompts = [r.prompt_token_ids for r in workload.requests]
    assert all(shared_blocks(a, b, 16) == 0 for i, a in enumerate(prompts) for b in prompts[:i])
    assert "no prompt content" in info.prefix_lines[0] and info.trace_reuse is None


def test_the_block_warning_reaches_question_2s_pitfalls_and_not_when_blocks_fit():
    from tokenmill.doctor.diagnose import _trace_evidence
    from tokenmill.doctor.findings import Finding

    rows = [TraceRow(float(i), 1536, 1, blocks=["a", f"b{i}", f"c{i}"]) for i in range(6)]
    _, info = shape(ParsedTrace("mooncake:x", rows, 512), Shaping(4096, 100, length_scale=1 / 64))
    prefix = Finding("2. Prompt redundancy", "v", [])
    _trace_evidence(prefix, info, {"cached_share": 0.0}, 16)
    assert prefix.pitfalls == [info.block_warning(16, 0.0)] and prefix.evidence[-1].startswith("replayed at")
    fitting = Finding("2. Prompt redundancy", "v", [])
    _trace_evidence(fitting, info, {"cached_share": 0.1}, 8)
    assert not fitting.pitfalls
