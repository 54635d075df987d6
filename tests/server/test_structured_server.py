"""Structured output and tool calls through the server, with the official `openai` client (no retries,
timeouts), on the bundled demo model (a chat template without a tools section: the tools go in a
system message): response_format json_schema and json_object, vLLM's guided fields, tool_choice
required and named, streamed and not; 400s naming the field; the Hermes-style parser on fixed texts."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.server_harness import start_server
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.server.tools import FunctionDef, ToolMode, ToolParam

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "maxItems": 2},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "maxLength": 12}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer with a call."}]


@pytest.fixture(scope="module")
def server():
    running = start_server(str(DEMO_MODEL), blocks=256, max_model_len=512)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_parses_and_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "A film, as JSON."}], max_tokens=100)
    texts = []
    for seed in range(3):
        r = client.chat.completions.create(**kwargs, response_format=fmt, temperature=1.0, seed=seed, stream=stream)
        if stream:
            chunks = list(r)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            texts.append(r.choices[0].message.content)
            assert r.choices[0].finish_reason == "stop"
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_the_guided_fields(server, client):
    r = client.completions.create(model="tiny", prompt="Data:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    picked = client.completions.create(model="tiny", prompt="Pick:", max_tokens=10, n=3, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["cat", "dog"]})  # fmt: skip
    assert {c.text for c in picked.choices} <= {"cat", "dog"}
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text  # n = 3 children: one compile, two hits
    hits = re.search(r'^tokenmill:structured_cache_hits_total\{model_name="tiny"\} ([0-9.]+)$', metrics, re.M)
    assert hits is not None and float(hits.group(1)) >= 2
    body = {"model": "tiny", "prompt": "Code:", "max_tokens": 12, "structured_outputs": {"regex": "[A-Z]{3}[0-9]{2}"}}
    coded = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    assert len(coded["choices"][0]["text"]) == 5 and coded["choices"][0]["text"][:3].isupper()


def test_bad_specs_and_conflicts_are_400s_naming_the_field(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]  # fmt: skip
    for kwargs, param in cases:
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_return_parseable_calls(client, stream):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=120, temperature=1.0, seed=5, stream=stream)  # fmt: skip
        if stream:  # (each call's first delta has its id and name, the rest fragments of its arguments)
            chunks = list(r)
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [] if tc.id]
            for call in calls:
                call.function.arguments = "".join(
                    tc.function.arguments for c in chunks if c.choices
                    for tc in c.choices[0].delta.tool_calls or [] if tc.index == call.index
                )  # fmt: skip
            finish = chunks[-1].choices[0].finish_reason
        else:
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call.id.startswith("call_") and call.function.name in params
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        if isinstance(choice, dict):
            assert all(c.function.name == "get_time" for c in calls)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_arrive_in_pieces_that_join_to_the_whole_answers_arguments(server, client, choice):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120,
                  temperature=1.0, seed=7)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices]
    deltas = [tc for p in pieces for tc in p]
    firsts = [tc for tc in deltas if tc.id is not None]
    # the first piece of each call: index, id, type, name and empty arguments; then the arguments in fragments
    assert [(tc.index, tc.type, tc.function.arguments) for tc in firsts] == [
        (k, "function", "") for k in range(len(firsts))
    ]
    assert [tc.function.name for tc in firsts] == [c.function.name for c in whole.message.tool_calls]
    for k, call in enumerate(whole.message.tool_calls):
        fragments = [tc.function.arguments for tc in deltas if tc.index == k and tc.id is None]
        assert len(fragments) > 1 and "".join(fragments) == call.function.arguments
        assert all(tc.function.name is None for tc in deltas if tc.index == k and tc.id is None)
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    server.wait_all_free()


def test_a_conversation_with_calls_and_their_results_is_accepted(client):
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_hermes_parser_on_fixed_texts():
    tools = (ToolParam(type="function", function=FunctionDef(name="get_weather")),)
    auto = ToolMode("auto", tools)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls, finish = auto.answer(text, "stop")
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    two += '<tool_call>{"name": "b", "parameters": {"x": 1}}</tool_call>'
    content, calls, _ = auto.answer(two, "stop")
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", "{}"),
        ("b", '{"x": 1}'),
    ]
    assert auto.answer("No call here.", "stop") == ("No call here.", [], "stop")
    assert auto.answer("<tool_call>{broken</tool_call>", "stop")[1] == []
    cut = ToolMode("required", tools).answer('[{"name": "get_weather", "argu', "length")
    assert cut == ('[{"name": "get_weather", "argu', [], "length")  # cut short: left as text
