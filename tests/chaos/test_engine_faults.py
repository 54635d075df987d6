"""Issue 42 item 2: one request's fault (or one step's) must not take the engine down for everyone.

Faults are injected into the worker and the core of a live server (monkeypatched): an exception in
the forward, NaN logits for one request, a failing KV allocation, an exception in one request's
logits processor, in its output processing, and one that ends the core's loop (the watchdog restarts
it). Each time the failed requests get an OpenAI-shaped error (a 500, or an error event mid-stream),
the others finish, the server keeps answering, and no KV block leaks.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.chaos.harness import assert_idle, slow_steps
from tests.server_harness import RunningServer, start_server
from tokenmill.engine.output_processor import OutputProcessor

TIMEOUT = httpx.Timeout(30.0)
LONG = {"model": "tiny", "max_tokens": 60, "ignore_eos": True}


@pytest.fixture
def serve(tiny_model_dir):
    started: list[RunningServer] = []

    def start(model: Path | None = None, step_sleep: float = 0.0, **kw: object) -> RunningServer:
        running = start_server(str(model or tiny_model_dir("llama")), greedy_head="logits", **kw)
        started.append(running)
        if step_sleep:
            slow_steps(running, step_sleep)
        return running

    yield start
    for running in started:
        assert_idle(running)
        assert httpx.get(f"{running.base_url}/health", timeout=TIMEOUT).status_code == 200
        running.stop()


def post(srv: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/completions", json={"model": "tiny", **body}, timeout=TIMEOUT)


def metric(srv: RunningServer, name: str) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"tokenmill:{name}{{"))


def failed_500(r: httpx.Response) -> str:
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "internal_error" and error["code"] == "request_failed" and "Traceback" not in r.text
    return error["message"]


def stream_lines(srv: RunningServer, body: dict) -> tuple[httpx.Response, object]:
    """A streaming request whose first event has arrived: (the response, its open line iterator)."""
    client = httpx.Client(timeout=TIMEOUT)
    r = client.send(client.build_request("POST", f"{srv.base_url}/v1/completions", json=body), stream=True)
    lines = r.iter_lines()
    assert r.status_code == 200 and next(line for line in lines if line.startswith("data: "))
    return r, lines


def stream_end(lines) -> dict | None:
    """The rest of a stream: its error event's error (None when it finished cleanly)."""
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    return last.get("error")


def in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_a_bad_word_past_the_embedding_is_a_400_and_bystanders_are_unaffected(serve, tiny_model_dir, tmp_path):
    """The issue's repro: a token added to tokenizer.json (an id the model has no embedding for) named
    in bad_words used to raise IndexError in the engine, failing a bystander and every later request."""
    model = tmp_path / "extra"
    shutil.copytree(tiny_model_dir("llama"), model)
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    extra = {"id": vocab, "content": "<|extra|>", "single_word": False, "lstrip": False, "rstrip": False}
    tok["added_tokens"].append({**extra, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tok))
    srv = serve(model)
    bystander, done = in_background(lambda: post(srv, {**LONG, "prompt": "a long one"}))
    for field in ({"bad_words": ["<|extra|>"]}, {"stop_token_ids": [vocab]}):
        r = post(srv, {"prompt": "hi", "max_tokens": 8, **field})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(field)), r.text
    bystander.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
    assert [post(srv, {"prompt": "hello", "max_tokens": 4}).status_code for _ in range(3)] == [200, 200, 200]


def test_an_exception_in_the_forward_fails_that_steps_requests_and_the_engine_serves_on(serve):
    srv = serve(step_sleep=0.005, max_num_seqs=1)
    model = srv.server.engine.clients[0].core.worker.runner.model
    forward = model.forward
    armed = threading.Event()

    def broken(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("CUDA error: an illegal memory access (injected)")
        return forward(*args, **kwargs)

    model.forward = broken
    r, lines = stream_lines(srv, {**LONG, "prompt": "first", "stream": True})
    waiting, done = in_background(lambda: post(srv, {**LONG, "prompt": "second"}))  # queued behind it
    deadline = time.monotonic() + 5
    while srv.stats().waiting < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    armed.set()
    error = stream_end(lines)
    r.close()
    assert error["type"] == "internal_error" and error["code"] == "request_failed"
    assert "the engine step it was in failed" in error["message"] and "illegal memory access" in error["message"]
    waiting.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60  # not in that step
    assert srv.stats().step_failures == 1 and metric(srv, "engine_step_failures_total") == 1
    assert metric(srv, "engine_request_faults_total") == 1
    assert post(srv, {"prompt": "after", "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_their_request_alone(serve, temperature):
    """The oldest request's logits row turns NaN for one step (greedy: argmax; sampled: the sampler);
    it fails, the request beside it in the same step finishes."""
    srv = serve(step_sleep=0.005)
    model = srv.server.engine.clients[0].core.worker.runner.model
    compute_logits = model.compute_logits
    armed = threading.Event()

    def nan_row(hidden):
        logits = compute_logits(hidden)
        if armed.is_set() and logits.shape[0] == 2:  # a decode step of both requests: row 0 is the first's
            armed.clear()
            logits[0] = float("nan")
        return logits

    model.compute_logits = nan_row
    first = {**LONG, "prompt": "first", "stream": True, "temperature": temperature, "seed": 1}
    r, lines = stream_lines(srv, first)
    beside, done = in_background(lambda: post(srv, {**LONG, "prompt": "second", "temperature": 0}))
    deadline = time.monotonic() + 5
    while srv.stats().running < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    armed.set()
    error = stream_end(lines)
    r.close()
    assert error["code"] == "request_failed" and "NaN" in error["message"]
    beside.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
    assert srv.stats().step_failures == 0


def test_a_failing_kv_allocation_fails_that_request_alone(serve):
    srv = serve()
    core = srv.server.engine.clients[0].core
    kv = core.scheduler.kv
    allocate = kv.allocate
    victim = srv.server.tokenizer.encode("doomed")

    def picky(request_id, num_tokens, keep_watermark=False):
        request = core.scheduler.requests.get(request_id)
        if request is not None and request.prompt_token_ids == victim:
            raise MemoryError("the block pool is corrupt (injected)")
        return allocate(request_id, num_tokens, keep_watermark=keep_watermark)

    kv.allocate = picky
    bystander, done = in_background(lambda: post(srv, {**LONG, "prompt": "a bystander"}))
    assert "KV blocks could not be allocated" in failed_500(post(srv, {"prompt": "doomed", "max_tokens": 4}))
    bystander.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
    assert metric(srv, "engine_request_faults_total") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_exception_in_one_requests_logits_processor_fails_it_alone(serve, stream):
    """Its logit_bias processor raises (as bad_words did on an id past the logits): that request fails,
    found by trying each row alone; the others in the step are sampled and finish."""
    srv = serve()
    batch = srv.server.engine.clients[0].core.worker.runner.batch
    bias = next(p for p in batch.processors if type(p).__name__ == "LogitBiasProcessor")
    apply = bias.apply

    def broken(logits, rows, row_ids):
        if any(7 in bias.state[r][0] for _, r in bias.rows_in(row_ids)):
            raise IndexError("index 4096 is out of bounds for dimension 1 with size 4096 (injected)")
        return apply(logits, rows, row_ids)

    bias.apply = broken
    bystander, done = in_background(lambda: post(srv, {**LONG, "prompt": "a bystander", "temperature": 1.0}))
    body = {**LONG, "prompt": "biased", "logit_bias": {"7": 5, "9": 1}, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            # (a 500 when it fails before its first token, an error event after)
            error = stream_end(r.iter_lines()) if r.status_code == 200 else json.loads(r.read())["error"]
        assert error["code"] == "request_failed" and "LogitBiasProcessor failed" in error["message"]
    else:
        assert "LogitBiasProcessor failed" in failed_500(post(srv, body))
    bystander.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
    assert srv.stats().step_failures == 0


def test_an_exception_processing_one_requests_output_fails_it_and_its_siblings_stop(serve, monkeypatch):
    """Its detokenizer / stop-string check raises in the front end: that request (all its prompts and
    n children) fails with a 500, the bystander finishes, no sibling keeps generating."""
    srv = serve()
    apply = OutputProcessor._apply

    def broken(self, parent, child, out):
        if "BOOM" in parent.params.stop and len(child.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte (injected)")
        return apply(self, parent, child, out)

    monkeypatch.setattr(OutputProcessor, "_apply", broken)
    bystander, done = in_background(lambda: post(srv, {**LONG, "prompt": "a bystander"}))
    before = srv.stats()
    r = post(srv, {**LONG, "prompt": ["one", "two"], "n": 2, "stop": ["BOOM"]})
    assert "its output could not be processed" in failed_500(r)
    bystander.join(30)
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
    stats = srv.wait_all_free(timeout=5)
    assert stats.generated_tokens - before.generated_tokens < 60 + 4 * 30  # the four sequences stopped early


def test_the_watchdog_restarts_a_core_whose_loop_died(serve):
    """An error outside any step (here: applying an abort) ends the core's loop: its open requests
    fail with an error, the watchdog restarts the loop on the same core, and the server serves on."""
    # (slowed steps: on a fast CPU the tiny model's 200 tokens came back inside the client's 0.2 s)
    srv = serve(step_sleep=0.005)
    engine = srv.server.engine
    core = engine.clients[0].core
    abort = core.abort_requests
    armed = threading.Event()

    def broken(request_ids):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("the abort path has a bug (injected)")
        abort(request_ids)

    core.abort_requests = broken
    r, lines = stream_lines(srv, {**LONG, "max_tokens": 200, "prompt": "survivor?", "stream": True})
    armed.set()
    with pytest.raises(httpx.TimeoutException):  # a client gone: its abort kills the loop
        httpx.post(
            f"{srv.base_url}/v1/completions",
            json={**LONG, "max_tokens": 200, "prompt": "impatient"},
            timeout=httpx.Timeout(30.0, read=0.2),
        )
    error = stream_end(lines)
    r.close()
    assert error["code"] == "request_failed" and "the engine failed" in error["message"]
    deadline = time.monotonic() + 10
    while httpx.get(f"{srv.base_url}/health", timeout=TIMEOUT).status_code != 200:  # degraded while it restarts
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.02)
    assert engine.clients[0].core is core and metric(srv, "engine_restarts_total") == 1
    assert post(srv, {"prompt": "after the restart", "max_tokens": 4}).status_code == 200
    # the same core's totals go on where they were: counted once, not again as a new replica's
    assert metric(srv, "generation_tokens_total") == srv.stats().generated_tokens
