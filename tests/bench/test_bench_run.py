"""The load generators end to end: offline through the engine (variants, the transformers baseline,
arrival control, multi-turn order), HTTP against a tokenmill server started here, and against a
server that fails in every way a server can (counted as failures; the run still finishes)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.server_harness import RunningServer, start_server
from tokenmill.bench.metrics import summarize
from tokenmill.bench.offline import run_offline
from tokenmill.bench.records import read_result
from tokenmill.bench.serve import ServeTarget, run_serve
from tokenmill.bench.workloads import WorkloadSpec, build_workload, send_times
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.launch import bind
from tokenmill.text.tokenizer import Tokenizer

KV = 128 * 24576  # 128 blocks of the tiny llama, float32
STEP_S = 2**-6  # fake seconds per engine step: a binary fraction, so sums of steps are exact
TICK_S = 0.25  # fake seconds per reading of the HTTP client's clock


class EngineTime:
    """Fake time for the offline driver: STEP_S passes per engine step and a sleep passes exactly its
    length, so every time a run records counts steps, whatever the machine's load. Notes when each
    request reached the engine."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.added: list[float] = []
        step, add = engine.step, engine.add_request

        def stepped() -> Any:
            outputs = step()
            self.now += STEP_S
            return outputs

        def adding(*args: Any, **kwargs: Any) -> Any:
            self.added.append(self.now)
            return add(*args, **kwargs)

        monkeypatch.setattr(engine, "step", stepped)
        monkeypatch.setattr(engine, "add_request", adding)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Ticks:
    """A clock that moves TICK_S each time it is read: with one request in flight, its times count the
    chunks read since it was sent, whatever the machine's load."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.reads * TICK_S


def no_leaks(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def tok(llama) -> Tokenizer:
    return Tokenizer(llama)


def test_offline_cli_compares_variants_and_the_transformers_baseline(llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", llama, "--workload", "mixed", "--num-requests", "6", "--input-len", "8:48"]
    argv += ["--output-len", "2:12", "--compare", "scheduling=static", "scheduling=continuous", "--baseline", "hf"]
    argv += ["--repeats", "2", "--max-model-len", "128", "--kv-cache-memory", str(KV), "--max-num-seqs", "4"]
    argv += ["--warmup", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "gain of scheduling=continuous over scheduling=static" in printed and "output tokens/s" in printed
    result = read_result(out)
    workload = build_workload(WorkloadSpec("mixed", 6, 0, (8, 48), (2, 12)), Tokenizer(llama))
    assert [(r.label, r.repeat) for r in result.runs] == [
        ("scheduling=static", 0),
        ("scheduling=continuous", 0),
        ("hf", 0),
        ("scheduling=continuous", 1),
        ("scheduling=static", 1),
        ("hf", 1),
    ]  # fmt: skip  (the variants' order rotates from one repeat to the next)
    for run in result.runs:  # every side served every request, exactly as asked
        assert [r.ok for r in run.records] == [True] * 6
        assert [r.output_tokens for r in run.records] == [q.max_tokens for q in workload.requests]
        assert [r.prompt_tokens for r in run.records] == [q.prompt_len for q in workload.requests]
        assert all(r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s for r in run.records)
        assert all(len(r.itl_s) <= r.output_tokens - 1 for r in run.records)
    assert result.runs[0].extras["kv_live_share"] > 0
    assert set(result.gains) == {
        "scheduling=continuous over scheduling=static", "scheduling=static over hf", "scheduling=continuous over hf",
    }  # fmt: skip
    assert len(result.gains["scheduling=continuous over hf"]["output_throughput"]["samples"]) == 2


def test_offline_concurrency_cap_and_multi_turn_order(llama, monkeypatch):
    engine = LLMEngine(EngineConfig(model=llama, max_model_len=256, kv_cache_memory=KV))
    # 4 conversations of 2 turns: 4 first turns due at once, so the cap of 2 is what holds them back
    spec = WorkloadSpec("multi-turn", num_requests=8, turns=2, input_len=(4, 12), output_len=(2, 6))
    workload = build_workload(spec, Tokenizer(llama))
    clock = EngineTime(engine, monkeypatch)  # times are whole steps: exact, so the span checks are too
    run = run_offline(engine, workload, "capped", max_concurrency=2, clock=clock, sleep=clock.sleep)
    assert all(r.ok for r in run.records)
    spans = [(r.start_s, r.start_s + r.e2e_s) for r in run.records]  # type: ignore[operator]
    in_flight = [sum(1 for s, e in spans if s <= t < e) for t, _ in spans]  # as each request starts
    assert max(in_flight) == 2  # never more than 2, and the cap was reached
    for q in workload.requests:  # a turn starts after its previous turn has finished
        if q.after is not None:
            assert spans[q.index][0] >= spans[q.after][1]
    assert run.records[2].cached_tokens is not None
    no_leaks(engine)
    poisson = build_workload(WorkloadSpec("random", 5, 1, (4, 8), (2, 3)), Tokenizer(llama))
    clock = EngineTime(engine, monkeypatch)
    paced = run_offline(engine, poisson, "p", request_rate=20.0, clock=clock, sleep=clock.sleep)
    due = send_times(poisson.requests, 20.0, 1)
    assert all(r.ok for r in paced.records)
    # each request starts when it was due (a server would have had it then), even if the engine was mid-step
    assert [r.start_s for r in paced.records] == due
    assert due[-1] > 8 * STEP_S  # type: ignore[operator]  # the arrivals spread over many steps
    # it reached the engine when due: not before, and no later than the end of the step under way then
    assert len(clock.added) == 5
    assert all(d <= a <= d + STEP_S for a, d in zip(clock.added, due, strict=True))  # type: ignore[operator]
    assert all(r.ttft_s >= STEP_S - 1e-9 for r in paced.records)  # type: ignore[operator]  # a step after it came
    assert paced.duration_s >= paced.records[-1].start_s + paced.records[-1].e2e_s  # type: ignore[operator]
    no_leaks(engine)


def test_offline_counts_refused_requests_as_failures(llama, tok, tmp_path):
    engine = LLMEngine(EngineConfig(model=llama, max_model_len=64, kv_cache_memory=KV))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 3}) for p in ["def f():", "x = 1 " * 80]) + "\n")
    run = run_offline(engine, build_workload(WorkloadSpec(f"jsonl:{trace}"), tok), "t")
    assert run.records[0].ok and not run.records[1].ok and "maximum model length" in (run.records[1].error or "")
    assert summarize(run.records, run.duration_s)["failed"] == 1
    no_leaks(engine)


@pytest.fixture(scope="module")
def srv(llama) -> RunningServer:
    server = start_server(llama, blocks=128)
    yield server
    server.stop()


def test_serve_against_a_tokenmill_server(srv, tok, llama, tmp_path):
    spec = WorkloadSpec(
        "shared-prefix", num_requests=8, seed=2, input_len=(4, 12), output_len=(3, 10), prefix_len=48, num_groups=2
    )
    workload = build_workload(spec, tok)
    run = run_serve(ServeTarget(srv.base_url, "tiny", timeout_s=60), workload, "t", max_concurrency=3, progress=False)
    assert [r.error for r in run.records] == [None] * 8
    assert [r.output_tokens for r in run.records] == [q.max_tokens for q in workload.requests]  # from usage
    assert [r.prompt_tokens for r in run.records] == [q.prompt_len for q in workload.requests]  # exact in tokens
    assert all(0 < r.ttft_s <= r.e2e_s for r in run.records)  # type: ignore[operator]
    assert sum(r.cached_tokens or 0 for r in run.records) >= 4 * 48  # later requests hit their group's prompt
    s = summarize(run.records, run.duration_s)
    assert s["completed"] == 8 and s["output_throughput"] > 0 and s["itl"] is not None
    # not streamed: one JSON body each, the same token counts from usage, TTFT = E2E and no gaps
    whole = run_serve(
        ServeTarget(srv.base_url, "tiny", timeout_s=60, stream=False), workload, "t", max_concurrency=3, progress=False
    )
    assert [r.error for r in whole.records] == [None] * 8
    assert [r.output_tokens for r in whole.records] == [q.max_tokens for q in workload.requests]
    assert all(r.ttft_s == r.e2e_s and r.e2e_s > 0 and r.itl_s == [] for r in whole.records)  # type: ignore[operator]
    stats = srv.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    # the command line: a sweep, the result file, and plots from it
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", srv.base_url + "/v1", "--model", "tiny", "--tokenizer", llama]
    argv += ["--workload", "random", "--num-requests", "4", "--input-len", "4:16", "--output-len", "2:6"]
    argv += ["--sweep", "max-concurrency=1,2", "--goodput", "ttft:60000", "--cost-per-hour", "1.0", "--no-progress"]
    argv += ["--api-key", "sk-secret"]
    assert main([*argv, "--out", str(out)]) == 0
    assert main([*argv, "--no-stream", "--out", str(tmp_path / "whole.json")]) == 0
    assert read_result(tmp_path / "whole.json").config["stream"] is False
    result = read_result(out)
    assert [r.label for r in result.runs] == ["max-concurrency=1", "max-concurrency=2"]
    assert result.command[:3] == ["tokenmill", "bench", "serve"] and "sk-secret" not in json.dumps(result.command)
    assert all(r.summary["completed"] == 4 and r.summary["goodput_share"] == 1.0 for r in result.runs)
    assert main(["bench", "plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "throughput_latency.png").read_bytes()[:4] == b"\x89PNG"
    assert srv.wait_all_free().kv_blocks_free == stats.kv_blocks_total


def faulty_app() -> FastAPI:
    """Behaves as the prompt says: error, drop (mid-stream), nodone, nousage, hang, trickle, multi
    (7 tokens in 3 chunks), ok."""
    app = FastAPI()

    def chunk(text: str, usage: dict | None = None) -> str:
        body = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        if usage is not None:
            body = {"choices": [], "usage": usage}
        return f"data: {json.dumps(body)}\n\n"

    @app.post("/v1/completions")
    async def complete(request: Request):
        kind = (await request.json())["prompt"]
        if kind == "error":
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=503)
        if kind == "detail":
            return JSONResponse({"detail": "unprocessable"}, status_code=422)

        async def stream():
            if kind == "multi":  # several tokens per chunk, as some servers send them
                for text in ("a b c", " d e", " f g"):
                    yield chunk(text)
                    await asyncio.sleep(0.01)
                yield chunk("", {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10})
                yield "data: [DONE]\n\n"
                return
            yield chunk("a")
            await asyncio.sleep(0.01)
            yield chunk(" b")
            if kind == "drop":
                raise RuntimeError("connection lost")  # uvicorn closes the connection mid-body
            if kind == "hang":
                await asyncio.sleep(30)
            if kind == "trickle":  # never silent for a whole read timeout, never done
                for _ in range(100):
                    await asyncio.sleep(0.3)
                    yield chunk(" c")
            if kind != "nousage":
                yield chunk("", {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
            if kind != "nodone":
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def faulty() -> Iterator[str]:
    """The base URL of `faulty_app`, served from a thread here."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(faulty_app(), log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_a_failing_server_is_counted_and_the_run_finishes(faulty, tok, tmp_path):
    kinds = ["ok", "error", "drop", "nodone", "nousage", "hang", "detail", "trickle", "multi", "ok"]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt": k, "max_tokens": 2}) for k in kinds) + "\n")
    workload = build_workload(WorkloadSpec(f"jsonl:{trace}"), None)
    target = ServeTarget(faulty, "m", timeout_s=1.5)
    start = time.monotonic()
    run = run_serve(target, workload, "faulty", max_concurrency=4, progress=False)
    assert time.monotonic() - start < 20  # not hung: "hang" and "trickle" would hold it 30 s without the timeout
    errors = dict(zip(kinds, [r.error for r in run.records], strict=True))
    assert [r.ok for r in run.records] == [True, False, False, False, False, False, False, False, True, True]
    assert errors["error"] == "HTTP 503: overloaded" and errors["detail"] == "HTTP 422: unprocessable"
    assert "RemoteProtocolError" in errors["drop"] or "ReadError" in errors["drop"]
    assert errors["nodone"] == "the stream ended before [DONE]"
    assert errors["nousage"] == "the server sent no usage; pass --tokenizer to count tokens"
    assert "timeout" in errors["hang"].lower()
    assert errors["trickle"] == "timeout: no complete response within 1.5 s"  # the whole request is bounded
    ok, multi = run.records[0], run.records[8]
    assert ok.output_tokens == 2 and len(ok.itl_s) == 1  # tokens from usage; one gap between the two chunks
    assert 0 < ok.ttft_s <= ok.e2e_s  # type: ignore[operator]
    assert ok.e2e_s == pytest.approx(ok.ttft_s + sum(ok.itl_s))  # type: ignore[operator]  # ends at the last token
    # 7 tokens in 3 chunks: the count from usage, two gaps, TPOT over the 6 tokens after the first
    assert (multi.output_tokens, multi.prompt_tokens, len(multi.itl_s)) == (7, 3, 2)
    assert multi.tpot_s == pytest.approx((multi.e2e_s - multi.ttft_s) / 6)  # type: ignore[operator]
    s = summarize(run.records, run.duration_s)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (3, 7, 11)
    # with a tokenizer, a server without usage is counted by tokenizing the text it streamed
    counted = run_serve(target, build_workload(WorkloadSpec(f"jsonl:{trace}"), tok), "t", tokenizer=tok, progress=False)
    assert counted.records[4].ok and counted.records[4].output_tokens == len(
        tok.encode("a b", add_special_tokens=False)
    )


def test_serve_times_chunks_and_counts_tokens_from_usage(faulty, tmp_path):
    # One request at a time and a clock that ticks once per reading: each time counts the chunks read
    # since the request was sent (the usage chunk is read too; [DONE] is not).
    kinds = ["multi", "ok"]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt": k, "max_tokens": 7}) for k in kinds) + "\n")
    workload = build_workload(WorkloadSpec(f"jsonl:{trace}"), None)
    run = run_serve(ServeTarget(faulty, "m", timeout_s=10), workload, "t", max_concurrency=1, clock=Ticks())
    multi, ok = run.records
    assert multi.ok and ok.ok
    # 7 tokens in 3 chunks: TTFT at the first, a gap per chunk after it, E2E at the last (not the usage chunk)
    assert (multi.ttft_s, multi.itl_s, multi.e2e_s) == (TICK_S, [TICK_S, TICK_S], 3 * TICK_S)
    assert (multi.output_tokens, multi.prompt_tokens) == (7, 3)  # from usage, not the 3 chunks
    assert multi.tpot_s == 2 * TICK_S / 6  # over the 6 tokens after the first, not the 2 chunks after it
    assert (ok.ttft_s, ok.itl_s, ok.e2e_s, ok.output_tokens, ok.tpot_s) == (TICK_S, [TICK_S], 2 * TICK_S, 2, TICK_S)
    assert ok.start_s > multi.start_s + multi.e2e_s  # type: ignore[operator]  # sent after the first finished
    s = summarize(run.records, run.duration_s)
    assert s["output_tokens"] == 9 and s["tpot"]["mean"] == pytest.approx((2 * TICK_S / 6 + TICK_S) / 2 * 1e3)
    assert s["itl"]["mean"] == pytest.approx(TICK_S * 1e3)  # three gaps of one tick each


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--request-rate", "inf"], "--request-rate"),
        (["--request-rate", "0"], "--request-rate"),
        (["--sweep", "max-concurrency=2,2"], "given twice"),
        (["--sweep", "request-rate=nan"], "--sweep"),
        (["--sweep", "speed=1"], "--sweep"),
        (["--goodput", "ttft:fast"], "--goodput"),
        (["--cost-per-hour", "nan"], "--cost-per-hour"),
        (["--timeout", "0"], "--timeout"),
        (["--workload", "chatty"], "--workload"),
        (["--input-len", "9:3"], "--input-len"),
    ],
)
def test_bad_bench_flags_are_one_clear_line(llama, tmp_path, capsys, extra, message):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", llama]
    assert main([*argv, "--no-progress", "--out", str(tmp_path / "r.json"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill bench serve: error:") and message in err and "Traceback" not in err


def test_offline_refuses_what_the_baseline_cannot_follow_before_loading(llama, tmp_path, capsys):
    argv = ["bench", "offline", llama, "--workload", "multi-turn", "--num-requests", "4", "--baseline", "hf"]
    assert main([*argv, "--out", str(tmp_path)]) == 2  # a folder as --out
    assert "--out" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "r.json")]) == 2
    assert "multi-turn dependencies" in capsys.readouterr().err
