"""A request of /v1/messages or /v1/responses that the engine fails alone (its output processing raises,
injected): whole, a 500 in the API's error shape; streamed, the API's failure event after the events
already sent (Anthropic's `error`, the Responses API's `response.failed`); a bystander finishes and no
KV block leaks."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.chaos.harness import assert_idle
from tests.server_harness import RunningServer, start_server
from tokenmill.engine.output_processor import OutputProcessor

FAIL_AT = 37  # max_tokens of the requests that fail (after their third token)
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture
def srv(tiny_model_dir, monkeypatch):
    apply = OutputProcessor._apply

    def broken(self, parent, child, out):
        if parent.params.max_tokens == FAIL_AT and len(child.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte (injected)")
        return apply(self, parent, child, out)

    monkeypatch.setattr(OutputProcessor, "_apply", broken)
    running = start_server(str(tiny_model_dir("llama")))
    yield running
    assert_idle(running)
    running.stop()


def events(srv: RunningServer, path: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{srv.base_url}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        blocks = r.read().decode().strip().split("\n\n")
    return [(b.split("\n")[0][7:], json.loads(b.split("\n")[1][6:])) for b in blocks]


def test_a_failed_message_is_an_anthropic_500_or_error_event(srv):
    body = {"model": "tiny", "max_tokens": FAIL_AT, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{srv.base_url}/v1/messages", json=body, timeout=TIMEOUT)
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert "Traceback" not in r.text
    stream = events(srv, "/v1/messages", body)
    assert stream[0][0] == "message_start" and stream[-1][0] == "error"
    assert stream[-1][1]["error"]["type"] == "api_error" and "did not finish" in stream[-1][1]["error"]["message"]
    fine = httpx.post(f"{srv.base_url}/v1/messages", json={**body, "max_tokens": 8}, timeout=TIMEOUT)
    assert fine.status_code == 200 and fine.json()["usage"]["output_tokens"] == 8


def test_a_failed_response_is_a_500_or_response_failed(srv):
    body = {"model": "tiny", "max_output_tokens": FAIL_AT, "input": "hi"}
    r = httpx.post(f"{srv.base_url}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    stream = events(srv, "/v1/responses", body)
    assert stream[0][0] == "response.created" and stream[-1][0] == "response.failed"
    failed = stream[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "request_failed"
    numbers = [payload["sequence_number"] for _, payload in stream]
    assert numbers == list(range(len(stream)))
    fine = httpx.post(f"{srv.base_url}/v1/responses", json={**body, "max_output_tokens": 8}, timeout=TIMEOUT)
    assert fine.status_code == 200 and fine.json()["usage"]["output_tokens"] == 8
