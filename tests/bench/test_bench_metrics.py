"""Benchmark arithmetic against hand-computed traces, workload determinism and exactness, and the
compare/aggregate layer."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from tokenmill.bench.compare import aggregate, label_of, parse_variant
from tokenmill.bench.metrics import distribution, gain, meets_slos, parse_slos, summarize
from tokenmill.bench.records import BenchResult, RequestRecord, Run
from tokenmill.bench.workloads import BUILT_IN, WorkloadSpec, build_workload, parse_range, send_times
from tokenmill.config import EngineConfig
from tokenmill.text.tokenizer import Tokenizer


def rec(
    index: int,
    ttft: float,
    arrivals: list[float],
    tokens: int,
    ok: bool = True,
    prompt: int = 10,
    cached: int | None = None,
) -> RequestRecord:
    """A request sent at 0 whose `tokens` output tokens arrived in chunks at `arrivals` (seconds)."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return RequestRecord(
        index, ok, None if ok else "HTTP 500: boom", 0.0, prompt, tokens, cached, ttft, arrivals[-1], gaps
    )


def test_ttft_tpot_itl_e2e_and_throughput_by_hand():
    # A: 4 tokens at 0.1, 0.2, 0.3, 0.7 s -> TPOT (0.7 - 0.1) / 3 = 0.2 s; ITL 0.1, 0.1, 0.4
    # B: 2 tokens at 0.3, 0.5 -> TPOT 0.2; ITL 0.2.  C: 1 token at 0.05 -> no TPOT, no ITL.  D failed.
    records = [
        rec(0, 0.1, [0.1, 0.2, 0.3, 0.7], 4),
        rec(1, 0.3, [0.3, 0.5], 2),
        rec(2, 0.05, [0.05], 1),
        RequestRecord(3, False, "HTTP 500: boom"),
    ]
    assert records[0].tpot_s == pytest.approx(0.2)
    assert records[2].tpot_s is None and records[3].tpot_s is None
    s = summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"], s["output_tokens"], s["prompt_tokens"]) == (3, 1, 7, 30)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["ttft"]["mean"] == pytest.approx(150.0)  # (100 + 300 + 50) / 3 ms
    assert s["ttft"]["median"] == pytest.approx(100.0)
    assert s["tpot"]["mean"] == pytest.approx(200.0) and s["tpot"]["p99"] == pytest.approx(200.0)
    assert s["itl"]["mean"] == pytest.approx(200.0)  # (100 + 100 + 400 + 200) / 4
    assert s["itl"]["median"] == pytest.approx(150.0)  # between 100 and 200
    assert s["e2e"]["max"] == pytest.approx(700.0) and s["e2e"]["min"] == pytest.approx(50.0)
    assert s["errors"] == {"HTTP 500: boom": 1}


def test_tpot_and_output_tokens_count_tokens_not_chunks():
    # Servers may put several tokens in one chunk; a chunk is one arrival (one ITL gap), TPOT divides by tokens.
    # A: 7 tokens in 3 chunks at 0.1, 0.4, 0.7 -> TPOT (0.7 - 0.1) / 6 = 0.1 (per chunk it would be 0.3); ITL 0.3, 0.3
    # B: 3 tokens in 2 chunks at 0.2, 0.6 -> TPOT 0.4 / 2 = 0.2 (per chunk 0.4); ITL 0.4
    # C: 4 tokens in 1 chunk at 0.05 -> TPOT 0 (no time after the first token); no ITL
    records = [rec(0, 0.1, [0.1, 0.4, 0.7], 7), rec(1, 0.2, [0.2, 0.6], 3), rec(2, 0.05, [0.05], 4)]
    assert [r.tpot_s for r in records] == pytest.approx([0.1, 0.2, 0.0])
    s = summarize(records, duration_s=2.0)
    assert s["output_tokens"] == 14 and s["output_throughput"] == pytest.approx(7.0)  # 14 tokens, 6 chunks
    assert s["total_token_throughput"] == pytest.approx(22.0)  # (30 + 14) / 2
    assert s["tpot"]["mean"] == pytest.approx(100.0)  # (100 + 200 + 0) / 3 ms
    assert s["tpot"]["max"] == pytest.approx(200.0) and s["tpot"]["min"] == 0.0
    assert s["itl"]["mean"] == pytest.approx(1000 / 3)  # (300 + 300 + 400) / 3: one sample per chunk gap
    assert s["itl"]["median"] == pytest.approx(300.0) and s["itl"]["max"] == pytest.approx(400.0)
    assert s["e2e"]["max"] == pytest.approx(700.0) and s["ttft"]["min"] == pytest.approx(50.0)


def test_cached_share_is_over_the_prompts_that_report_cached_tokens():
    records = [
        rec(0, 0.1, [0.1], 1, prompt=10, cached=5),
        rec(1, 0.1, [0.1], 1, prompt=20),  # reports nothing: in neither sum
        rec(2, 0.1, [0.1], 1, prompt=30, cached=15),
        rec(3, 0.1, [0.1], 1, prompt=40, cached=0),  # reports no hit: counts
        RequestRecord(4, False, "dropped", prompt_tokens=100, cached_tokens=100),  # failed: not counted
    ]
    s = summarize(records, 1.0)
    assert s["cached_tokens"] == 20 and s["prompt_tokens"] == 100
    assert s["cached_share"] == pytest.approx(20 / 80)  # not 20 / 100 (all prompts) nor 120 / 180 (failed too)
    none = summarize([rec(0, 0.1, [0.1], 1), rec(1, 0.1, [0.1], 1)], 1.0)
    assert none["cached_tokens"] is None and none["cached_share"] is None  # nobody reports: unknown, not 0
    zero = summarize([rec(0, 0.1, [0.1], 1, cached=0)], 1.0)
    assert zero["cached_tokens"] == 0 and zero["cached_share"] == 0.0  # reported, no hit


def test_meets_slos_checks_each_measure_in_ms_and_never_a_failure():
    r = rec(0, 0.125, [0.125, 0.25, 0.375], 3)  # ttft 125 ms, tpot 125 ms, e2e 375 ms
    assert meets_slos(r, {"ttft": 125, "tpot": 125, "e2e": 375})  # at the limit passes
    assert not meets_slos(r, {"ttft": 124})
    assert not meets_slos(r, {"tpot": 124})
    assert not meets_slos(r, {"e2e": 374})
    assert not meets_slos(r, {"ttft": 500, "tpot": 500, "e2e": 374})  # one miss is enough
    assert meets_slos(r, {}) and meets_slos(r, {"e2e": 400})
    one = rec(1, 0.125, [0.125], 1)  # a 1-token reply has no TPOT: a TPOT SLO does not fail it
    assert one.tpot_s is None and meets_slos(one, {"tpot": 1, "ttft": 200})
    assert not meets_slos(one, {"tpot": 1, "e2e": 100})
    fast_but_failed = rec(2, 0.001, [0.001, 0.002], 2, ok=False)
    assert not meets_slos(fast_but_failed, {"ttft": 1000, "tpot": 1000, "e2e": 1000})
    assert not meets_slos(fast_but_failed, {})
    assert not meets_slos(RequestRecord(3, False, "dropped"), {"ttft": 1000})


def test_goodput_with_an_e2e_slo_and_failures_in_the_share():
    records = [
        rec(0, 0.1, [0.1, 0.2, 0.3], 3),  # ttft 100, tpot 100, e2e 300: good
        rec(1, 0.1, [0.1, 0.3, 0.5], 3),  # ttft 100, tpot 200, e2e 500: fails only the e2e SLO
        rec(2, 0.05, [0.05], 1),  # ttft 50, no tpot, e2e 50: good
        rec(3, 0.3, [0.3, 0.35], 2),  # ttft 300: fails ttft
        RequestRecord(4, False, "dropped"),
        RequestRecord(5, False, "HTTP 503: overloaded"),
    ]
    slos = parse_slos("ttft:200,tpot:250,e2e:400")
    assert slos == {"ttft": 200.0, "tpot": 250.0, "e2e": 400.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, True, False, False, False]
    s = summarize(records, 2.0, slos)
    assert s["slos_ms"] == slos
    assert s["goodput"] == pytest.approx(1.0)  # 2 good requests in 2 s
    assert s["goodput_share"] == pytest.approx(2 / 6)  # of every request sent, failed ones included
    without_e2e = summarize(records, 2.0, parse_slos("ttft:200,tpot:250"))
    assert without_e2e["goodput"] == pytest.approx(1.5) and without_e2e["goodput_share"] == pytest.approx(3 / 6)
    assert "goodput" not in summarize(records, 2.0)  # no SLOs, no goodput
    assert summarize([RequestRecord(0, False, "x")], 1.0, slos)["goodput_share"] == 0.0


def test_percentiles_interpolate_linearly():
    values = [0.001 * v for v in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
    d = distribution(values)
    assert d is not None
    assert d["median"] == pytest.approx(5.5) and d["p90"] == pytest.approx(9.1) and d["p99"] == pytest.approx(9.91)
    assert d["p90"] == pytest.approx(float(np.percentile(np.arange(1, 11), 90)))
    assert distribution([]) is None


def test_goodput_counts_requests_meeting_every_slo_and_cost():
    records = [
        rec(0, 0.1, [0.1, 0.2, 0.3], 3),  # ttft 100 ms, tpot 100 ms: fails tpot:60
        rec(1, 0.05, [0.05, 0.1, 0.15], 3),  # ttft 50, tpot 50: good
        rec(2, 0.4, [0.4, 0.45], 2),  # ttft 400: fails ttft:200
        rec(3, 0.02, [0.02], 1),  # ttft 20, no tpot: good
        RequestRecord(4, False, "dropped"),
    ]
    s = summarize(records, 4.0, parse_slos("ttft:200,tpot:60"), cost_per_hour=3.6)
    assert s["goodput"] == pytest.approx(0.5)  # 2 good requests in 4 s
    assert s["goodput_share"] == pytest.approx(2 / 5)
    # 3.6 USD/h for 4 s = 0.004 USD for 9 output tokens -> per million
    assert s["cost_per_million_output_tokens"] == pytest.approx(0.004 / 9 * 1e6)
    for bad in ("ttft", "ttft:abc", "speed:5", "tpot:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slos(bad)
    with pytest.raises(ValueError, match="duration_s"):
        summarize(records, 0.0)


def test_gain_direction_and_aggregate_over_interleaved_repeats():
    assert gain("output_throughput", 200.0, 100.0) == 2.0
    assert gain("ttft.median", 50.0, 100.0) == 2.0  # half the time: twice as good
    assert gain("completed", 10.0, 5.0) is None  # counts are not ranked

    def run(label: str, repeat: int, tps: float) -> Run:
        records = [rec(0, 0.1, [0.1, 0.2], 2)]
        r = Run(label, repeat, {}, 1.0, records, summarize(records, 1.0))
        r.summary["output_throughput"] = tps
        return r

    result = BenchResult(
        "offline", [], {}, {}, [run("a", 0, 100), run("b", 0, 150), run("a", 1, 120), run("b", 1, 120)]
    )
    aggregate(result, ["a"])
    assert result.aggregate["b"]["output_throughput"]["median"] == 135
    g = result.gains["b over a"]["output_throughput"]
    assert g["samples"] == [1.5, 1.0] and g["median"] == 1.25 and (g["min"], g["max"]) == (1.0, 1.5)


def test_compare_variants_parse_to_typed_engine_overrides():
    base = EngineConfig(model="m")
    v = parse_variant("scheduling=static,max-num-seqs=8,enable_prefix_caching=off,max_model_len=512", base)
    assert v == {"scheduling": "static", "max_num_seqs": 8, "enable_prefix_caching": False, "max_model_len": 512}
    assert label_of(v) == "scheduling=static,max_num_seqs=8,enable_prefix_caching=false,max_model_len=512"
    dataclasses.replace(base, **v)  # valid for the engine config
    for bad, field in (("speed=3", "speed"), ("max_num_seqs=many", "max_num_seqs"), ("enable_prefix_caching=2", "")):
        with pytest.raises(ValueError, match=f"--compare.*{field}"):
            parse_variant(bad, base)
    # a JSON value keeps its commas; "none" is None for an optional setting
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert parse_variant(f"speculative_config={spec},max_num_seqs=4", base) == {
        "speculative_config": spec,
        "max_num_seqs": 4,
    }
    assert parse_variant("speculative_config=none", base) == {"speculative_config": None}
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens: required"):
        parse_variant('speculative_config={"method": "ngram"}', base)


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir("llama"))


@pytest.mark.parametrize("name", BUILT_IN)
def test_workloads_are_deterministic_and_exact_in_tokens(tok, name):
    spec = WorkloadSpec(name, num_requests=12, seed=5, input_len=(8, 40), output_len=(3, 20), prefix_len=32)
    a, b = build_workload(spec, tok), build_workload(spec, tok)
    assert [(r.prompt, r.max_tokens, r.after) for r in a.requests] == [
        (r.prompt, r.max_tokens, r.after) for r in b.requests
    ]
    other = build_workload(dataclasses.replace(spec, seed=6), tok)
    assert [r.prompt for r in other.requests] != [r.prompt for r in a.requests]
    for r in a.requests:  # the text a server gets encodes to exactly the planned tokens
        assert r.prompt is not None and tok.encode(r.prompt) == r.prompt_token_ids
        assert r.max_tokens >= 1
    lens = [r.prompt_len for r in a.requests]
    if name in ("random", "mixed"):
        assert all(8 <= n <= 40 for n in lens) and all(3 <= r.max_tokens <= 20 for r in a.requests)
    if name == "shared-prefix":  # 4 groups of a 32-token system prompt, each request one group's prompt + a question
        ids = [r.prompt_token_ids for r in a.requests]
        assert all(ids[i][:32] == ids[i + 4][:32] for i in range(8)) and ids[0][:32] != ids[1][:32]
        assert all(40 <= n <= 72 for n in lens)
    if name == "multi-turn":  # 3 conversations x 4 turns, each turn resending the previous prompt
        assert [r.after for r in a.requests[:4]] == [None, None, None, 0]
        for r in a.requests[3:]:
            prev = a.requests[r.after].prompt_token_ids
            assert r.prompt_token_ids[: len(prev)] == prev and len(r.prompt_token_ids) > len(prev)
    if name == "code-edit":
        assert all(r.prompt.startswith("Rewrite the following Python code") for r in a.requests)


def test_arrivals_poisson_seeded_trace_and_dependencies(tok, tmp_path):
    spec = WorkloadSpec("multi-turn", num_requests=6, turns=2, input_len=(4, 8), output_len=(2, 4))
    reqs = build_workload(spec, tok).requests
    times = send_times(reqs, 2.0, seed=1)
    assert times[3:] == [None, None, None] and times[:3] == send_times(reqs, 2.0, seed=1)[:3]
    assert times[0] == 0.0 < times[1] < times[2]  # type: ignore[operator]  # the first is sent at once
    gaps = np.diff(
        [
            0.0,
            *send_times(
                build_workload(dataclasses.replace(spec, name="random", num_requests=2000), tok).requests, 4.0, 0
            ),
        ]
    )  # type: ignore[list-item]
    assert abs(gaps.mean() - 0.25) < 0.02  # exponential gaps with mean 1 / rate
    assert send_times(reqs[:3], None, 0) == [0.0, 0.0, 0.0]
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"prompt": "def f(x):", "max_tokens": 5, "arrival_time": 1.5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        + "\n"
        + json.dumps({"prompt": [5, 6, 7], "max_tokens": 2})
        + "\n"
    )
    w = build_workload(WorkloadSpec(f"jsonl:{trace}", num_requests=10), tok)
    assert [r.max_tokens for r in w.requests] == [5, 3, 2]
    assert w.requests[0].prompt_token_ids == tok.encode("def f(x):")
    assert w.requests[1].messages and w.requests[1].prompt_token_ids == tok.apply_chat_template(w.requests[1].messages)
    assert w.requests[2].prompt_token_ids == [5, 6, 7] and w.requests[2].prompt == tok.decode([5, 6, 7])
    assert send_times(w.requests, None, 0) == [1.5, 0.0, 0.0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{nope", "line 1: not JSON"),
        ('{"prompt": "x"}', "line 1: max_tokens"),
        ('{"prompt": "x", "max_tokens": 0}', "line 1: max_tokens"),
        ('{"prompt": "x", "messages": [], "max_tokens": 2}', "exactly one of prompt or messages"),
        ('{"prompt": "", "max_tokens": 2}', "prompt must be non-empty"),
        ('{"messages": [{"role": "user"}], "max_tokens": 2}', "messages must be"),
        ('{"prompt": "x", "max_tokens": 2, "arrival_time": -1}', "arrival_time"),
    ],
)
def test_bad_trace_lines_name_file_line_and_field(tok, tmp_path, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        build_workload(WorkloadSpec(f"jsonl:{trace}"), tok)


def test_bad_workload_flags_are_clear_errors(tok):
    with pytest.raises(ValueError, match="--workload"):
        WorkloadSpec("chatty")
    with pytest.raises(ValueError, match="--input-len"):
        WorkloadSpec("random", input_len=(10, 5))
    with pytest.raises(ValueError, match="--output-len"):
        parse_range("a:b", "--output-len")
    assert parse_range("64", "--input-len") == (64, 64)
    with pytest.raises(ValueError, match="--tokenizer"):
        build_workload(WorkloadSpec("random"), None)
    with pytest.raises(ValueError, match="cannot read"):
        build_workload(WorkloadSpec("jsonl:/nonexistent/trace.jsonl"), tok)
