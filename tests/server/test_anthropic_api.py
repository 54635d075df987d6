"""POST /v1/messages (Anthropic's Messages API) through the server on a tiny make-model folder: each
answer against the chat endpoint's answer to the same request (the oracle: both run greedy on the
same engine), streamed against whole, Anthropic's event sequence, stop sequences, a forced tool call
and its result sent back, structured output, thinking blocks from a reasoning parser, auth by
x-api-key or bearer, and bad inputs as 400s in Anthropic's error shape naming the field (never a 500).
Every test ends with no KV block held (the chat oracle's included)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from tests.server.think_model import think_model
from tests.server_harness import RunningServer, start_server

KEY = "sk-test-anthropic"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
ASK = [{"role": "user", "content": "Say hi."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("anthropic") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    think_model(folder)  # (<think> tokens and a template, for the thinking blocks)
    running = start_server(str(folder), api_key=KEY, blocks=64)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_leaks(server) -> Iterator[None]:
    yield
    server.server.reasoning_parser = None
    stats = server.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0, stats


def messages(server: RunningServer, headers: dict[str, str] | None = None, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/messages", json=body, headers=headers or HEADERS, timeout=60)


def events(server: RunningServer, **body) -> list[tuple[str, dict]]:
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json={**body, "stream": True}, headers=HEADERS, timeout=60
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == kind[7:]
        out.append((kind[7:], payload))
    return out


def chat(server: RunningServer, **body) -> dict:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_answer_and_streams_the_same(server):
    r = messages(server, system="Be brief.", messages=ASK, max_tokens=12, temperature=0)
    assert r.status_code == 200, r.text
    m = r.json()
    system = [{"role": "system", "content": "Be brief."}]
    oracle = chat(server, messages=system + ASK, max_tokens=12, temperature=0)
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": oracle["choices"][0]["message"]["content"]}]
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    assert m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] == oracle["usage"]["prompt_tokens"]
    assert m["usage"]["output_tokens"] == 12
    stream = events(server, system=[{"type": "text", "text": "Be brief."}], messages=ASK, max_tokens=12, temperature=0)
    kinds = [k for k, _ in stream]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    text = "".join(p["delta"]["text"] for k, p in stream if k == "content_block_delta")
    assert text == m["content"][0]["text"]
    delta = stream[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12
    assert stream[0][1]["message"]["usage"]["input_tokens"] == oracle["usage"]["prompt_tokens"]


def test_a_stop_sequence_is_named(server):
    whole = messages(server, messages=ASK, max_tokens=12, temperature=0).json()["content"][0]["text"]
    stop = whole[4:7]
    m = messages(server, messages=ASK, max_tokens=12, temperature=0, stop_sequences=[stop]).json()
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop
    assert m["content"][0]["text"] == whole[: whole.index(stop)]


def test_a_forced_tool_call_and_its_result(server):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 48, "tools": [WEATHER]}
    m = messages(server, **body, tool_choice={"type": "tool", "name": "get_weather"}).json()
    assert m["stop_reason"] == "tool_use"
    (use,) = [b for b in m["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather"
    jsonschema.validate(use["input"], WEATHER["input_schema"])
    stream = events(server, **body, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    starts = [p["content_block"] for k, p in stream if k == "content_block_start"]
    assert [s["type"] for s in starts] == ["tool_use"] and starts[0]["input"] == {}
    pieces = [p["delta"]["partial_json"] for k, p in stream if k == "content_block_delta"]
    assert len(pieces) > 1  # (the arguments stream as they are generated)
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["input_schema"])
    assert [k for k, _ in stream].count("content_block_stop") == 1
    assert stream[-2][1]["delta"]["stop_reason"] == "tool_use"
    back = body["messages"] + [
        {"role": "assistant", "content": m["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]},
    ]
    after = messages(server, messages=back, max_tokens=4, tools=[WEATHER], temperature=0)
    assert after.status_code == 200, after.text
    calls = [
        {
            "id": use["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(use["input"])},
        }
    ]
    tool_chat = [*body["messages"], {"role": "assistant", "content": "", "tool_calls": calls}]
    tool_chat.append({"role": "tool", "tool_call_id": use["id"], "content": "sunny"})
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    oracle = chat(server, messages=tool_chat, max_tokens=4, tools=tools, temperature=0)
    assert after.json()["content"][0]["text"] == oracle["choices"][0]["message"]["content"]


def test_structured_output_and_thinking_blocks(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    m = messages(
        server, messages=ASK, max_tokens=24, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    assert m.status_code == 200, m.text
    jsonschema.validate(json.loads(m.json()["content"][0]["text"]), schema)
    server.server.reasoning_parser = "deepseek_r1"  # (the answer starts inside the reasoning: all of it here)
    thought = messages(server, messages=ASK, max_tokens=8, temperature=0).json()
    assert [b["type"] for b in thought["content"]] == ["thinking"] and thought["content"][0]["signature"] == ""
    stream = events(server, messages=ASK, max_tokens=8, temperature=0)
    starts = [p["content_block"]["type"] for k, p in stream if k == "content_block_start"]
    assert starts == ["thinking"]
    text = "".join(p["delta"]["thinking"] for k, p in stream if k == "content_block_delta")
    assert text == thought["content"][0]["thinking"]
    hidden = messages(
        server, messages=ASK, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 8, "display": "omitted"}
    )
    assert hidden.status_code == 200 and hidden.json()["content"] == []


def test_bearer_and_x_api_key_and_a_401_in_anthropic_shape(server):
    bearer = messages(server, {"Authorization": f"Bearer {KEY}"}, messages=ASK, max_tokens=1)
    assert bearer.status_code == 200
    wrong = messages(server, {"x-api-key": "nope"}, messages=ASK, max_tokens=1)
    assert wrong.status_code == 401
    assert wrong.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": wrong.json()["error"]["message"]},
    }
    missing = httpx.get(f"{server.base_url}/v1/messages", headers=HEADERS)
    assert missing.status_code == 405 and missing.json()["type"] == "error"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 10**6}, "max_tokens"),
        ({"messages": ASK, "max_tokens": "8"}, "max_tokens"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 4},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
          "max_tokens": 4}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}], "max_tokens": 4},
         "messages[0].content[0].tool_use_id"),
        ({"messages": ASK, "max_tokens": 4, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences[0]"),
        ({"messages": ASK, "max_tokens": 4, "stop_sequences": ["x"] * 99}, "stop_sequences"),
        ({"messages": ASK, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0].type"),
        ({"messages": ASK, "max_tokens": 4, "tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name"),
        ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": ASK, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "f"}},
         "tool_choice.name"),
        ({"messages": ASK, "max_tokens": 4,
          "output_config": {"format": {"type": "json_schema", "schema": {"type": 3}}}}, "output_config.format"),
        ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"messages": ASK, "max_tokens": 4, "stream": "yes"}, "stream"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400s_in_anthropic_shape_naming_the_field(server, body, field):
    r = messages(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert f"'{field}" in error["error"]["message"] or error["error"]["message"].startswith(field), error


@pytest.mark.parametrize("raw", [b"[]", b"not json", b'{"messages": 3, "max_tokens": 1}', b"{" * 500])
def test_bodies_that_are_not_a_request_are_400s(server, raw):
    r = httpx.post(
        f"{server.base_url}/v1/messages", content=raw, headers={**HEADERS, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_unknown_fields_are_ignored_and_listed(server):
    r = messages(server, messages=ASK, max_tokens=1, speed="fast", inference_geo="us")
    assert r.status_code == 200 and r.headers["x-tokenmill-ignored-fields"] == "speed,inference_geo"


def test_a_client_gone_mid_stream_frees_its_blocks(server):
    body = {"messages": ASK, "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break  # (the connection closes here; the no_leaks fixture checks the blocks)
