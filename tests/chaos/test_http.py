"""Issue 42 items 5, 6, 8, 9 at the HTTP front door: body size (413), JSON depth and lone surrogates
(400 naming the limit or the field), an unexpected error (an OpenAI-shaped 500 with a request id, the
traceback only in the log), the API key on every endpoint but /health, request preparation off the
event loop, and (tests/chaos/test_connections.py) slow clients and the connection cap."""

from __future__ import annotations

import hashlib
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from tests.server_harness import RunningServer, start_server
from tokenmill.cli import build_parser
from tokenmill.engine_args import settings_from
from tokenmill.server.front_door import FrontDoor, parse_api_keys

KEYS = ("key-one", "key-two")
LIMIT = 2 << 20  # bytes: small, so a test body passes it cheaply
DEPTH = 32
TIMEOUT = 30.0


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _whoami(app: FastAPI) -> None:
    @app.get("/whoami")
    async def whoami(request: Request) -> dict[str, str | None]:
        return {"tenant": getattr(request.state, "tenant", None)}


@pytest.fixture(scope="module")
def srv(tiny_model_dir) -> RunningServer:
    front = FrontDoor(max_body_bytes=LIMIT, max_json_depth=DEPTH)
    running = start_server(str(tiny_model_dir("llama")), api_key=",".join(KEYS), front=front, prepare_app=_whoami)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_leaks(srv):
    yield
    stats = srv.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0, stats


def post(srv: RunningServer, path: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **auth(), **(headers or {})}
    return httpx.post(f"{srv.base_url}{path}", content=raw, headers=headers, timeout=TIMEOUT)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- item 5: body size ---------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_by_its_content_length(srv):
    body = json.dumps({"model": "tiny", "prompt": "x" * LIMIT}).encode()
    error = error_of(post(srv, "/v1/completions", body), 413)
    assert error["code"] == "body_too_large" and str(LIMIT) in error["message"]
    small = json.dumps({"model": "tiny", "prompt": "x" * (LIMIT // 2), "max_tokens": 1}).encode()
    assert error_of(post(srv, "/v1/completions", small), 400)["param"] == "prompt"  # read: then too long


def test_a_chunked_body_is_refused_once_its_chunks_pass_the_limit_not_after_all_of_it(srv):
    """Raw HTTP/1.1 with chunked encoding: the 413 arrives while the client is still sending."""
    host, port = srv.base_url.removeprefix("http://").split(":")
    chunk = b"x" * (16 << 10)
    sent = 0
    answer = b""
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {KEYS[0]}\r\n"
        s.sendall((head + "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n").encode())
        while sent < 16 * LIMIT and b"\r\n\r\n" not in answer:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                while select.select([s], [], [], 0)[0] and b"\r\n\r\n" not in answer:
                    answer += s.recv(65536)
            except OSError:  # (closed by the server after its answer)
                break
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 4 * LIMIT, f"{sent} bytes sent before the 413 (limit {LIMIT})"


# -- item 8: JSON and text hygiene ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_deep_nesting_is_a_400_naming_the_limit(srv, path):
    error = error_of(post(srv, path, b"[" * 100_000), 400)
    assert error["code"] == "nesting_too_deep" and f"at most {DEPTH}" in error["message"]
    inner = DEPTH - 1  # the object around them is one level
    deep = b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "extra": ' + b"[" * inner + b"]" * inner + b"}"
    if path == "/v1/completions":  # at the limit: read (the unknown field is ignored)
        assert post(srv, path, deep).status_code == 200
        over = deep.replace(b"[", b"[[", 1).replace(b"]", b"]]", 1)
        assert error_of(post(srv, path, over), 400)["code"] == "nesting_too_deep"


def test_brackets_inside_strings_do_not_count_as_depth(srv):
    body = {"model": "tiny", "prompt": "[{" * 500 + '\\"[' + "]" * 40}
    assert post(srv, "/tokenize", json.dumps(body).encode()).status_code == 200


def test_a_number_of_thousands_of_digits_is_a_400(srv):
    body = b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"  # (past Python's int digits cap)
    assert error_of(post(srv, "/v1/completions", body), 400)["code"] == "invalid_json"


def test_a_recursion_error_while_preparing_is_a_400(srv, monkeypatch):
    def recurse(req: object, tenant: object = None) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(srv.server, "prepare_completion", recurse)
    error = error_of(post(srv, "/v1/completions", b'{"model": "tiny", "prompt": "x"}'), 400)
    assert error["code"] == "nesting_too_deep"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\xed\xa0\x80"], "max_tokens": 1}', "stop[0]"),  # raw bytes
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udbff"}]}', "messages[0].content"),
        ("/detokenize", b'{"model": "\\ud800", "tokens": [1]}', "model"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(srv, path, body, param):
    error = error_of(post(srv, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_surrogate_pair_is_text(srv):
    r = post(srv, "/tokenize", b'{"prompt": "smile \\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["count"] > 1


def test_an_unexpected_error_is_an_openai_500_with_its_request_id_in_the_log(srv, monkeypatch, caplog):
    def broken(req: object, tenant: object = None) -> None:
        raise KeyError("secret detail")

    monkeypatch.setattr(srv.server, "prepare_completion", broken)
    with caplog.at_level(logging.ERROR, logger="tokenmill"):
        r = post(srv, "/v1/completions", b'{"model": "tiny", "prompt": "x"}')
    error = error_of(r, 500)
    request_id = r.headers["x-request-id"]
    assert error["message"] == f"internal error (request id {request_id})" and error["type"] == "server_error"
    assert "secret detail" not in r.text and "Traceback" not in r.text
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and "secret detail" in str(logged[0].exc_info[1])


# -- item 9: auth ----------------------------------------------------------------------------------


def test_every_endpoint_but_health_needs_a_key(srv):
    routes = {(m, r.path) for r in srv.uvicorn_server.config.app.routes for m in getattr(r, "methods", ()) or ()}
    routes |= {("GET", "/no/such/path")}
    assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/openapi.json")} <= routes
    for method, path in sorted(routes - {("HEAD", p) for _, p in routes}):
        r = httpx.request(method, f"{srv.base_url}{path}", timeout=TIMEOUT)
        if path == "/health":
            assert r.status_code == 200
        elif path == "/v1/messages":  # (Anthropic's error shape: tests/server/test_anthropic_api.py)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
            assert r.headers["www-authenticate"] == "Bearer"
        else:
            error = error_of(r, 401)
            assert error["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer", path
    assert httpx.get(f"{srv.base_url}/metrics", headers=auth(), timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": f"bearer {KEYS[0]}"},
        {"authorization": f"BEARER   {KEYS[1]}"},
        {"x-api-key": KEYS[1]},
    ],
)
def test_the_scheme_is_case_insensitive_and_x_api_key_works(srv, headers):
    assert httpx.get(f"{srv.base_url}/v1/models", headers=headers, timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": f"Bearer {KEYS[0]}x"},
        {"authorization": f"Bearer {KEYS[0][:-1]}"},
        {"authorization": f"Basic {KEYS[0]}"},
        {"authorization": "Bearer"},
        {"authorization": f"Bearer {KEYS[0]},{KEYS[1]}"},
        {"x-api-key": ""},
    ],
)
def test_a_wrong_key_is_refused(srv, headers):
    assert httpx.get(f"{srv.base_url}/v1/models", headers=headers, timeout=TIMEOUT).status_code == 401


def test_the_tenant_is_a_short_hash_of_the_key(srv):
    tenants = [httpx.get(f"{srv.base_url}/whoami", headers=auth(k), timeout=TIMEOUT).json()["tenant"] for k in KEYS]
    assert tenants == [hashlib.sha256(k.encode()).hexdigest()[:16] for k in KEYS]


def test_metrics_public_opens_metrics_alone():
    from tokenmill.server.auth import ApiKeyCheck

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    from starlette.testclient import TestClient

    client = TestClient(ApiKeyCheck(ok, ["k"], metrics_public=True))
    assert [client.get(p).status_code for p in ("/metrics", "/health", "/tokenize", "/metrics/x")] == [
        200,
        200,
        401,
        401,
    ]


def test_keys_come_from_repeated_flags_or_commas():
    from tokenmill.server.settings import ServeSettings

    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b, c", "--api-key", "a"])
    assert parse_api_keys([settings_from(ServeSettings, args, {}).api_key]) == ("a", "b", "c")


# -- item 5: preparation off the event loop --------------------------------------------------------


def test_a_big_tokenize_does_not_stall_the_event_loop(srv):
    text = "the quick brown fox jumps over the lazy dog; " * 30000  # 1.35 MB: about a second of encoding
    body = json.dumps({"prompt": text}).encode()
    assert len(body) < LIMIT
    done = threading.Event()
    answers: list[float] = []

    def poll() -> None:
        while not done.is_set():
            t = time.perf_counter()
            assert httpx.get(f"{srv.base_url}/health", timeout=TIMEOUT).status_code == 200
            answers.append(time.perf_counter() - t)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t = time.perf_counter()
        assert post(srv, "/tokenize", body).status_code == 200
        took = time.perf_counter() - t
    finally:
        done.set()
        poller.join()
    assert len(answers) >= 5, f"{len(answers)} health answers during {took:.2f} s of tokenization"
    assert max(answers) < took / 2, (took, answers)
