"""POST /v1/responses (OpenAI's Responses API, stateless) through the server on a tiny make-model folder,
with the official `openai` client where it can say it: each answer against the chat endpoint's answer
to the same request (the oracle: both greedy on the same engine), streamed against whole with the
event sequence, a function call and its output sent back, text.format json_schema, reasoning items
from a reasoning parser, `store: true` / `previous_response_id` refused, and bad inputs as 400s naming
the field (never a 500). Every test ends with no KV block held."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.server.think_model import think_model
from tests.server_harness import RunningServer, start_server

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("responses") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    think_model(folder)
    running = start_server(str(folder), blocks=64)
    yield running
    running.stop()


@pytest.fixture
def client(server) -> Iterator[OpenAI]:
    yield OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    server.server.reasoning_parser = None
    stats = server.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0, stats


def chat(server: RunningServer, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_is_the_chat_answer_and_streams_the_same(server, client):
    r = client.responses.create(
        model="tiny", instructions="Be brief.", input="Say hi.", max_output_tokens=12, temperature=0
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    oracle = chat(server, messages=messages, max_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions == "Be brief."
    assert r.output_text == oracle["choices"][0]["message"]["content"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == oracle["usage"]["prompt_tokens"] and r.usage.output_tokens == 12
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]
    events = list(client.responses.create(model="tiny", instructions="Be brief.", input=parts, max_output_tokens=12,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_a_function_call_and_its_output(server, client):
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model="tiny", input=asked, tools=[WEATHER], max_output_tokens=48,
                                tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model="tiny", input=asked, tools=[WEATHER], max_output_tokens=48,
                                          tool_choice="required", parallel_tool_calls=False, stream=True))  # fmt: skip
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 1  # (the arguments stream as they are generated)
    assert len(done) == 1 and done[0].arguments == "".join(pieces) and events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])
    back = [*asked, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]  # fmt: skip
    after = client.responses.create(model="tiny", input=back, tools=[WEATHER], max_output_tokens=4, temperature=0)
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    chat_back = [*asked, {"role": "assistant", "content": "", "tool_calls": calls},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # fmt: skip
    oracle = chat(server, messages=chat_back, tools=tools, max_tokens=4, temperature=0)
    assert after.output_text == oracle["choices"][0]["message"]["content"]


def test_text_format_json_schema_and_the_stream_helper(server, client):
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model="tiny", input="A number.", max_output_tokens=32, text=fmt)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with client.responses.stream(model="tiny", input="A number.", max_output_tokens=32, text=fmt, temperature=0) as s:
        final = s.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    obj = client.responses.create(
        model="tiny", input="JSON.", max_output_tokens=40, text={"format": {"type": "json_object"}}
    )
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_reasoning_items(server, client):
    server.server.reasoning_parser = "deepseek_r1"  # (the answer starts inside the reasoning: all of it here)
    r = client.responses.create(
        model="tiny", input="hi", max_output_tokens=8, temperature=0, reasoning={"effort": "low"}
    )
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].text and r.output_text == ""
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=8, temperature=0, stream=True,
                                          reasoning={"effort": "low"}))  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == item.content[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "background": True}, "background"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
         "text.format"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400s_naming_the_field(server, client, body, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or (error["param"] or "").startswith(param), error
    assert error["type"] == "invalid_request_error"


def test_store_refused_through_the_client(client):
    with pytest.raises(BadRequestError, match="stateless"):
        client.responses.create(model="tiny", input="hi", store=True)
