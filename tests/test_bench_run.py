"""The load generators end to end: offline through the engine (variants, the transformers baseline,
arrival control, multi-turn order), HTTP against a tokenmill server started here, and against a
server that fails in every way a server can (counted as failures; the run still finishes)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

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
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.server.launch import bind

KV = 128 * 24576  # 128 blocks of the tiny llama, float32


def no_leaks(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == stats["waiting"] == 0


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


def test_offline_concurrency_cap_and_multi_turn_order(llama):
    engine = LLMEngine(EngineConfig(model=llama, max_model_len=256, kv_cache_memory=KV))
    spec = WorkloadSpec("multi-turn", num_requests=8, turns=4, input_len=(4, 12), output_len=(2, 6))
    workload = build_workload(spec, Tokenizer(llama))
    run = run_offline(engine, workload, "capped", max_concurrency=2)
    assert all(r.ok for r in run.records)
    spans = [(r.start_s, r.start_s + r.e2e_s) for r in run.records]  # type: ignore[operator]
    for t, _ in spans:  # never more than 2 in flight when one starts
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    for q in workload.requests:  # a turn starts after its previous turn has finished
        if q.after is not None:
            assert spans[q.index][0] >= spans[q.after][1]
    assert run.records[2].cached_tokens is not None
    no_leaks(engine)
    poisson = build_workload(WorkloadSpec("random", 5, 1, (4, 8), (2, 3)), Tokenizer(llama))
    paced = run_offline(engine, poisson, "p", request_rate=20.0)
    # each request starts when it was due (a server would have had it then), even if the engine was mid-step
    assert [r.start_s for r in paced.records] == send_times(poisson.requests, 20.0, 1)
    assert paced.records[-1].start_s > 0.02 and all(r.ok for r in paced.records)
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
    stats = srv.wait_all_free()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # the command line: a sweep, the result file, and plots from it
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", srv.base_url + "/v1", "--model", "tiny", "--tokenizer", llama]
    argv += ["--workload", "random", "--num-requests", "4", "--input-len", "4:16", "--output-len", "2:6"]
    argv += ["--sweep", "max-concurrency=1,2", "--goodput", "ttft:60000", "--cost-per-hour", "1.0", "--no-progress"]
    argv += ["--api-key", "sk-secret"]
    assert main([*argv, "--out", str(out)]) == 0
    result = read_result(out)
    assert [r.label for r in result.runs] == ["max-concurrency=1", "max-concurrency=2"]
    assert result.command[:3] == ["tokenmill", "bench", "serve"] and "sk-secret" not in json.dumps(result.command)
    assert all(r.summary["completed"] == 4 and r.summary["goodput_share"] == 1.0 for r in result.runs)
    assert main(["bench", "plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "throughput_latency.png").read_bytes()[:4] == b"\x89PNG"
    assert srv.wait_all_free()["kv_blocks_free"] == stats["kv_blocks_total"]


def faulty_app() -> FastAPI:
    """Behaves as the prompt says: error, drop (mid-stream), nodone, nousage, hang, ok."""
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


def test_a_failing_server_is_counted_and_the_run_finishes(tok, tmp_path):
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(faulty_app(), log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        kinds = ["ok", "error", "drop", "nodone", "nousage", "hang", "detail", "trickle", "ok"]
        trace = tmp_path / "t.jsonl"
        trace.write_text("\n".join(json.dumps({"prompt": k, "max_tokens": 2}) for k in kinds) + "\n")
        workload = build_workload(WorkloadSpec(f"jsonl:{trace}"), None)
        target = ServeTarget(f"http://127.0.0.1:{sock.getsockname()[1]}", "m", timeout_s=1.5)
        start = time.monotonic()
        run = run_serve(target, workload, "faulty", max_concurrency=4, progress=False)
        assert time.monotonic() - start < 20
        errors = dict(zip(kinds, [r.error for r in run.records], strict=True))
        assert [r.ok for r in run.records] == [True, False, False, False, False, False, False, False, True]
        assert errors["error"] == "HTTP 503: overloaded" and errors["detail"] == "HTTP 422: unprocessable"
        assert "RemoteProtocolError" in errors["drop"] or "ReadError" in errors["drop"]
        assert errors["nodone"] == "the stream ended before [DONE]"
        assert errors["nousage"] == "the server sent no usage; pass --tokenizer to count tokens"
        assert "timeout" in errors["hang"].lower()
        assert errors["trickle"] == "timeout: no complete response within 1.5 s"  # the whole request is bounded
        assert run.records[0].output_tokens == 2  # from usage
        assert run.records[0].e2e_s < 1.0 and len(run.records[0].itl_s) == 1
        s = summarize(run.records, run.duration_s)
        assert (s["completed"], s["failed"]) == (2, 7)
        # with a tokenizer, a server without usage is counted by tokenizing the text it streamed
        counted = run_serve(
            target, build_workload(WorkloadSpec(f"jsonl:{trace}"), tok), "t", tokenizer=tok, progress=False
        )
        assert counted.records[4].ok and counted.records[4].output_tokens == len(
            tok.encode("a b", add_special_tokens=False)
        )
    finally:
        server.should_exit = True
        thread.join(10)


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
