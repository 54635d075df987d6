"""The OpenAI-compatible server, through the official openai client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.server_harness import RunningServer, start_server

API_KEY = "test-key"
TIMEOUT = httpx.Timeout(30.0)
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def srv(tiny_model_dir) -> RunningServer:
    running = start_server(str(tiny_model_dir("llama")), api_key=API_KEY)
    yield running
    running.stop()


@pytest.fixture
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30.0)


@pytest.fixture(autouse=True)
def no_leaks(request, srv):
    yield
    stats = srv.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def post(srv: RunningServer, path: str, body: object, key: str | None = API_KEY, raw: bytes | None = None):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{srv.base_url}{path}", content=content, headers=headers, timeout=TIMEOUT)


def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{srv.base_url}/health", timeout=TIMEOUT).status_code == 200


def test_completion_streamed_equals_whole_and_usage_counts(srv, client):
    tok = srv.server.tokenizer
    prompt = "def fibonacci(n):\n    "
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.usage.prompt_tokens == len(tok.encode(prompt)) == chunks[-1].usage.prompt_tokens
    assert whole.usage.completion_tokens == 12 == chunks[-1].usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert whole.choices[0].finish_reason == "length"


def test_model_may_be_left_out_as_vllm_allows(srv):
    """No `model` (or null): the served one; the reply names it. Another name is refused."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0}),
    ):
        named = post(srv, path, body | {"model": "tiny"})
        for unnamed in (body, body | {"model": None}):
            r = post(srv, path, unnamed)
            assert r.status_code == 200 and r.json()["model"] == "tiny"
            assert r.json()["choices"][0] == named.json()["choices"][0]
        r = post(srv, path, body | {"model": "other"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_chat_streamed_equals_whole(srv, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    expected = srv.server.tokenizer.apply_chat_template(messages)
    assert whole.usage.prompt_tokens == len(expected)


def test_n_seed_stop_and_logprobs(client):
    a = client.completions.create(model="tiny", prompt="import os", max_tokens=8, n=2, seed=5, temperature=1.0)
    b = client.completions.create(model="tiny", prompt="import os", max_tokens=8, n=2, seed=5, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    full = client.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = client.completions.create(model="tiny", prompt="x = 1", max_tokens=4, temperature=0, logprobs=3)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and len(logprobs.top_logprobs[0]) >= 3
    assert all(v <= 0 for v in logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert content[0].logprob == pytest.approx(max(t.logprob for t in content[0].top_logprobs))


def test_several_prompts_and_echo(client):
    out = client.completions.create(model="tiny", prompt=["a = 1", "b = 2"], max_tokens=3, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("a = 1") and out.choices[1].text.startswith("b = 2")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "other", "prompt": "x"}, "model"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 300}, "max_tokens"),
        ({"model": "tiny", "prompt": "x " * 200, "max_tokens": 100}, "prompt"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "tiny", "prompt": [[1, 99999]]}, "prompt[0]"),
        ({"model": "tiny", "prompt": "x", "n": 9}, "n"),
        ({"model": "tiny", "prompt": "x", "tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_field(srv, body, param):
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_other_errors(srv):
    r = post(srv, "/v1/completions", None, raw=b'{"model": "tiny", "prompt": ')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0]")
    r = post(
        srv,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function"  # (a tool needs its function)
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "x"}, key="wrong")
    assert r.status_code == 401
    r = httpx.get(f"{srv.base_url}/v2/nothing", headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()
    r = post(srv, "/v1/completions", [1, 2])
    assert r.status_code == 400


def test_client_disconnect_mid_stream_stops_generation_and_frees_blocks(srv):
    body = {"model": "tiny", "prompt": "for i in range(10):", "max_tokens": 200, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    before = srv.stats()
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert srv.stats().running == 1
    stats = srv.wait_all_free(timeout=5)  # within a few engine steps of the close
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0
    assert stats.aborted == before.aborted + 1
    generated = stats.generated_tokens - before.generated_tokens
    assert 1 <= generated < 100, f"{generated} of 200 tokens generated: the abort came late or never"
    text = httpx.get(f"{srv.base_url}/metrics", headers=AUTH, timeout=TIMEOUT).text
    assert 'tokenmill:request_success_total{finished_reason="abort",model_name="tiny"}' in text


def test_burst_beyond_max_waiting_is_refused_politely(srv):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT, headers={"authorization": f"Bearer {API_KEY}"}) as c:
            body = {"model": "tiny", "prompt": "while True:", "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{srv.base_url}/v1/completions", json=body) for _ in range(80)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 8
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 16


def test_metrics_use_vllm_names(srv, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    text = httpx.get(f"{srv.base_url}/metrics", headers=AUTH, timeout=TIMEOUT).text
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ):
        assert f"tokenmill:{name}" in text, name
    assert 'finished_reason="length"' in text


@pytest.mark.slow  # ~11 s; the default run draws requests from the schema per route (tests/chaos/test_fields.py)
def test_openapi_fuzzing_finds_no_server_error(srv):
    """A bounded schemathesis run against /openapi.json: whatever it sends, no 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    headers = {"authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{srv.base_url}/openapi.json", headers=headers)
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=10, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 4)  # keep generation short
            if isinstance(case.body, dict):
                case.body.pop("stream", None)
            response = case.call(headers=headers, timeout=30)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        check()
        checked += 1
    assert checked >= 5


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "def handler(event, context):\n    " * 6
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert again.choices[0].text == first.choices[0].text


def test_cache_salt_isolates_tenants(client):
    prompt = "class Config:\n    debug = False\n" * 6
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    same = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    other = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "b"})
    assert same.usage.prompt_tokens_details.cached_tokens >= 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def stream_events(srv: RunningServer, path: str, body: dict) -> list[dict]:
    """Every JSON event of a streamed response (the stream must end with [DONE])."""
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{srv.base_url}{path}", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streaming_n_and_several_prompts_index_choices_as_prompt_times_n_plus_child(srv):
    body = {"model": "tiny", "prompt": ["a = 1", "def f(x):"], "n": 3, "max_tokens": 6, "seed": 11}
    body |= {"temperature": 1.0, "echo": True, "ignore_eos": True}
    whole = post(srv, "/v1/completions", body).json()
    events = stream_events(srv, "/v1/completions", {**body, "stream": True})
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    assert sorted(texts) == list(range(6)) and reasons == dict.fromkeys(range(6), "length")
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # same seeds, same text per choice
    for index, text in texts.items():
        assert text.startswith(body["prompt"][index // 3])  # the echo names choice i * n + j's prompt i
    assert len({texts[i] for i in range(3)}) > 1  # the children of one prompt differ


def test_streamed_logprobs_equal_the_whole_response(srv):
    body = {"model": "tiny", "prompt": "import sys", "max_tokens": 7, "temperature": 0, "logprobs": 2}
    whole = post(srv, "/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]["logprobs"]
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in stream_events(srv, "/v1/completions", {**body, "ignore_eos": True, "stream": True}):
        for c in e["choices"]:
            if c["logprobs"] is not None:
                tokens += c["logprobs"]["tokens"]
                token_logprobs += c["logprobs"]["token_logprobs"]
                tops += c["logprobs"]["top_logprobs"]
                offsets += c["logprobs"]["text_offset"]
    assert tokens == whole["tokens"] and len(tokens) == 7
    assert token_logprobs == pytest.approx(whole["token_logprobs"], abs=1e-6)
    assert [sorted(t) for t in tops] == [sorted(t) for t in whole["top_logprobs"]]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    content = post(srv, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    streamed = [
        entry
        for e in stream_events(srv, "/v1/chat/completions", {**chat, "stream": True})
        for c in e["choices"]
        if c.get("logprobs")
        for entry in c["logprobs"]["content"]
    ]
    assert [x["token"] for x in streamed] == [x["token"] for x in content] and len(content) == 4
    assert [x["logprob"] for x in streamed] == pytest.approx([x["logprob"] for x in content], abs=1e-6)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(srv, tiny_model_dir, hf_logits):
    import torch

    prompt = "def add(a, b):\n    return"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    choice = post(srv, "/v1/completions", body).json()["choices"][0]
    plain = post(srv, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    ids = srv.server.tokenizer.encode(prompt)
    lp = choice["logprobs"]
    assert choice["text"] == prompt + plain["text"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    ref = torch.log_softmax(hf_logits(tiny_model_dir("llama"), torch.tensor(ids)), dim=-1)
    expected = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-6)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_streaming_with_include_usage_ends_with_the_usage_chunk(srv):
    messages = [{"role": "user", "content": "count to three"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    events = stream_events(
        srv, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, last = events
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert last["usage"]["completion_tokens"] == 5
    assert last["usage"]["prompt_tokens"] == len(srv.server.tokenizer.apply_chat_template(messages))
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert all(e.get("usage") is None for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_unexpected_error_is_a_500_in_openai_shape(srv, monkeypatch):
    def broken(req: object, tenant: object = None) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(srv.server, "prepare_completion", broken)
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert r.status_code == 500
    request_id = r.headers["x-request-id"]
    assert r.json() == {
        "error": {
            "message": f"internal error (request id {request_id})",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert "a bug" not in r.text and "Traceback" not in r.text


def test_a_draining_server_refuses_with_503_and_its_health_says_so(tiny_model_dir):
    running = start_server(str(tiny_model_dir("llama")))
    try:
        running.server.engine.begin_drain()
        r = post(running, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, key=None)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{running.base_url}/health", timeout=TIMEOUT).status_code == 503
    finally:
        running.stop()


def test_an_error_escaping_a_step_fails_open_requests_and_the_engine_serves_on(tiny_model_dir):
    running = start_server(str(tiny_model_dir("llama")))
    try:
        core = running.server.engine.clients[0].core
        long = {"model": "tiny", "prompt": "while True:", "max_tokens": 240, "ignore_eos": True}
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(post(running, "/v1/completions", long, key=None)))
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            waiter.start()
            deadline = time.monotonic() + 10
            while running.stats().running < 2:
                assert time.monotonic() < deadline, "the second request never started"
                time.sleep(0.005)

            def crash() -> None:
                raise RuntimeError("a bug in the step")

            core.step = crash  # the engine thread's next step raises, outside any request's part
            rest = [line for line in lines if line.startswith("data: ")]
        waiter.join(10)
        assert not waiter.is_alive()
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "internal_error" and "the engine failed" in error["message"]
        assert whole[0].status_code == 500 and whole[0].json()["error"]["type"] == "internal_error"
        assert "Traceback" not in whole[0].text
        stats = running.stats()  # the requests failed and their blocks were freed
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0 and stats.step_failures == 1
        del core.step  # (the bug fixed) the same engine serves on
        assert httpx.get(f"{running.base_url}/health", timeout=TIMEOUT).status_code == 200
        r = post(running, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, key=None)
        assert r.status_code == 200
    finally:
        running.stop()


def test_unknown_fields_are_ignored_named_in_a_header_and_logged_once(srv, caplog):
    body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 2, "guidellm_run_id": "r1", "temprature": 0.1}
    with caplog.at_level("WARNING", logger="tokenmill"):
        first = post(srv, "/v1/completions", body)
        again = post(srv, "/v1/completions", body)
        odd = post(srv, "/v1/completions", {**body, "clé ✓": 1, "a,b": 2})  # a header is ASCII: percent-encoded
    assert first.status_code == again.status_code == 200, first.text
    assert first.headers["x-tokenmill-ignored-fields"] == "guidellm_run_id,temprature"
    assert odd.status_code == 200 and odd.headers["x-tokenmill-ignored-fields"].endswith(",cl%C3%A9%20%E2%9C%93,a%2Cb")
    warned = [r.getMessage() for r in caplog.records if "ignored unknown request fields" in r.getMessage()]
    # once per field name and server (the module's server may have seen these names in an earlier test)
    assert sum("temprature" in w for w in warned) <= 1 and sum("a,b" in w for w in warned) == 1
    assert "temprature" in srv.server.warned_fields
    clean = {k: v for k, v in body.items() if k not in ("guidellm_run_id", "temprature")}
    assert "x-tokenmill-ignored-fields" not in post(srv, "/v1/completions", clean).headers


def test_strict_fields_refuse_unknown_fields(tiny_model_dir):
    from tokenmill.server.protocol import RequestCaps

    running = start_server(str(tiny_model_dir("llama")))
    try:
        running.server.limits = RequestCaps(max_n=4, strict_fields=True)
        r = post(running, "/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, key=None)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    finally:
        running.stop()


def test_logit_bias_and_min_tokens_through_the_api(srv):
    eos = srv.server.tokenizer.info.eos_token_ids[0]
    body = {"model": "tiny", "prompt": "import os", "max_tokens": 20, "temperature": 0}
    forced = post(srv, "/v1/completions", {**body, "logit_bias": {str(eos): 100}}).json()
    assert forced["usage"]["completion_tokens"] == 1 and forced["choices"][0]["finish_reason"] == "stop"
    held = post(srv, "/v1/completions", {**body, "logit_bias": {str(eos): 100}, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    long = post(srv, "/v1/chat/completions", {**chat, "logit_bias": {str(eos): -100}}).json()
    assert long["usage"]["completion_tokens"] == 20 and long["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_usage_in_every_chunk(srv):
    body = {"model": "tiny", "prompt": ["a = 1", "b = 2"], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream_events(srv, "/v1/completions", {**body, "stream": True, "stream_options": options})
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 10 and completions[0] >= 1
    prompt_tokens = sum(len(srv.server.tokenizer.encode(p)) for p in body["prompt"])
    assert {u["prompt_tokens"] for u in usages} == {prompt_tokens}


def test_tokenize_detokenize_and_the_model_length(srv, client):
    tok = srv.server.tokenizer
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": "def f(x): return x", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("def f(x): return x") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and "".join(r["token_strs"]) == tok.decode(r["tokens"], skip_special_tokens=False)
    messages = [{"role": "user", "content": "hello"}]
    chat = post(srv, "/tokenize", {"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages)
    back = post(srv, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.decode(r["tokens"], skip_special_tokens=False)
    bad = post(srv, "/detokenize", {"tokens": [1, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    both = post(srv, "/tokenize", {"prompt": "x", "messages": messages})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    assert client.models.list().data[0].max_model_len == 256


def test_no_orphans_when_a_streaming_client_of_several_prompts_and_n_leaves(srv, caplog):
    before = srv.stats()
    body = {"model": "tiny", "prompt": ["for x in y:", "while z:"], "n": 2, "max_tokens": 200, "ignore_eos": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with caplog.at_level("WARNING"):
        with httpx.stream(
            "POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=TIMEOUT
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        stats = srv.wait_all_free(timeout=5)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
    assert stats.aborted == before.aborted + 4  # every sequence of every prompt
    assert stats.generated_tokens - before.generated_tokens < 4 * 100
    assert not [r for r in caplog.records if r.levelname == "ERROR" or "aclose" in r.getMessage()]


def test_no_orphans_when_a_non_streaming_client_leaves(srv):
    before = srv.stats()
    body = {"model": "tiny", "prompt": ["for x in y:", "while z:"], "n": 4, "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
        httpx.post(
            f"{srv.base_url}/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(30.0, read=0.3),
        )
    stats = srv.wait_all_free(timeout=5)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
    assert stats.aborted == before.aborted + 8
    assert stats.generated_tokens - before.generated_tokens < 8 * 240


def test_no_orphans_when_a_queued_client_leaves(tiny_model_dir):
    running = start_server(str(tiny_model_dir("llama")), max_num_seqs=1)
    try:
        worker = running.server.engine.clients[0].core.worker
        execute = worker.execute

        def slow(scheduled):  # 5 ms a step: the stream below runs >= 1.2 s, whatever the machine
            time.sleep(0.005)
            return execute(scheduled)

        worker.execute = slow
        long = {"model": "tiny", "prompt": "while True:", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=long, timeout=TIMEOUT) as r:
            lines = r.iter_lines()  # held: dropping the iterator would close the connection
            assert next(line for line in lines if line.startswith("data:"))
            with pytest.raises(httpx.TimeoutException):  # queued behind the stream, then gone
                httpx.post(
                    f"{running.base_url}/v1/completions",
                    json={"model": "tiny", "prompt": "x", "max_tokens": 4},
                    timeout=httpx.Timeout(30.0, read=0.3),
                )
            deadline = time.monotonic() + 5
            while running.stats().aborted < 1:  # the queued request, and only it, is aborted
                assert time.monotonic() < deadline, running.stats()
                time.sleep(0.01)
            stats = running.stats()
            assert stats.aborted == 1 and stats.running == 1 and stats.waiting == 0  # the stream goes on
        stats = running.wait_all_free(timeout=5)
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
    finally:
        running.stop()


def test_a_penalty_beyond_float32_is_a_400_not_an_engine_crash(srv):
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "repetition_penalty": 1e300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    assert srv.server.engine.healthy
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": "x"}).status_code == 200


def test_no_orphans_when_a_client_leaves_during_prefill(tiny_model_dir):
    running = start_server(str(tiny_model_dir("llama")), max_num_batched_tokens=8)
    try:
        worker = running.server.engine.clients[0].core.worker
        execute = worker.execute

        def slow(scheduled):  # 10 ms a step: a 200-token prompt in chunks of 8 takes >= 250 ms
            time.sleep(0.01)
            return execute(scheduled)

        worker.execute = slow
        prompt = list(range(10, 210))
        with pytest.raises(httpx.TimeoutException):  # (gone after the request is prepared off the loop)
            httpx.post(
                f"{running.base_url}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 8},
                timeout=httpx.Timeout(30.0, read=0.1),
            )
        stats = running.wait_all_free(timeout=5)
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
        assert stats.aborted == 1 and stats.generated_tokens == 0  # gone before its prompt was computed
        assert 0 < stats.prompt_tokens < 200
    finally:
        running.stop()
