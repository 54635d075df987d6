"""Reasoning output (`--reasoning-parser`): the splitter on fixed texts cut every way (never a tag across
deltas, streamed == whole), and through the server on a tiny make-model folder whose tokenizer has
`<think>` / `</think>` tokens: the split against the same server's unsplit answer (the oracle), the
prompt's state (a template that opens or closes the reasoning, `chat_template_kwargs`), `reasoning_effort`
reaching the template, structured output and forced tool calls applying after `</think>`, 400s naming
the field. Every test ends with no KV block held."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.server.think_model import think_model
from tests.server_harness import RunningServer, start_server
from tokenmill.server.reasoning import END, START, ReasoningSplitter, reasoning_splits

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "hi"}]
BIAS = 4  # on </think>: greedy, the tiny model writes one reasoning token, then </think>


# ------------------------------------------------------------------------------------------ splitter

TEXTS = [
    ("lead", "content", "<think>a<b</think>\n\nanswer"),
    ("lead", "content", "  <think>\nwhy</think>x</think>"),
    ("lead", "content", "no tags at all <"),
    ("lead", "content", "<thin"),
    ("lead", "reasoning", "all reasoning <"),
    ("lead", "reasoning", "<think>dropped lead</think>then content <think>"),
    ("content", "content", "<think>kept</think>"),
]


def _whole(start: str, fallback: str, text: str) -> tuple[str, str, bool]:
    s = ReasoningSplitter(start, fallback)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2, s.reasoned


def _cuts(text: str) -> Iterator[list[str]]:
    """`text` cut at every pair of places, and one character at a time."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize(("start", "fallback", "text"), TEXTS)
def test_streamed_deltas_join_to_the_whole_split_and_never_cut_a_tag(start, fallback, text):
    whole = _whole(start, fallback, text)
    for pieces in _cuts(text):
        s = ReasoningSplitter(start, fallback)
        out = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in out), "".join(c for _, c in out), s.reasoned) == whole
        for r, _ in out[:-1]:  # (until the end, no delta ends in the start of a tag it could not tell yet)
            assert START not in r and END not in r
            assert not any(r.endswith(END[:k]) for k in range(1, len(END))) or not r


def test_the_split_of_fixed_texts():
    assert _whole("lead", "content", "<think>a<b</think>\n\nanswer") == ("a<b", "\n\nanswer", True)
    assert _whole("lead", "content", "plain <think> later") == ("", "plain <think> later", False)
    assert _whole("lead", "reasoning", "thinking, never closed") == ("thinking, never closed", "", True)
    assert _whole("lead", "reasoning", "<think>x</think>y") == ("x", "y", True)
    assert _whole("content", "content", "<think>x</think>y") == ("", "<think>x</think>y", False)
    assert reasoning_splits("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n").start == "content"
    assert reasoning_splits("qwen3", "assistant\n<think>\n").fallback == "reasoning"
    assert reasoning_splits("qwen3", "assistant\n").fallback == "content"
    assert reasoning_splits("deepseek_r1", "assistant\n").fallback == "reasoning"
    assert reasoning_splits("qwen3", "x", include=False).split("<think>r</think>c") == (None, "c")


# ------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def folder(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("think") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), out)
    think_model(out)
    return out


@pytest.fixture(scope="module")
def server(folder) -> Iterator[RunningServer]:
    running = start_server(str(folder), blocks=64)
    yield running
    running.stop()


@pytest.fixture
def parser(server) -> Iterator[callable]:
    def use(name: str | None) -> None:
        server.server.reasoning_parser = name

    yield use
    server.server.reasoning_parser = None
    stats = server.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def chat(server: RunningServer, **body) -> dict:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server: RunningServer, **body) -> list[dict]:
    body = {"messages": ASK, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def test_deepseek_r1_splits_the_answer_and_the_grammar_starts_after_think(server, parser, folder):
    ids = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    bias = {"logit_bias": {str(ids[END]): BIAS}, "max_tokens": 30}
    free = chat(server, **bias)["choices"][0]["message"]["content"]  # no parser, no grammar: the oracle
    assert END in free
    thought = free.split(END)[0]
    parser("deepseek_r1")
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    whole = chat(server, **bias, **fmt)["choices"][0]
    assert whole["message"]["reasoning_content"] == thought and thought  # (the reasoning was not constrained)
    jsonschema.validate(json.loads(whole["message"]["content"]), SCHEMA)
    assert whole["finish_reason"] == "stop"
    chunks = chat_stream(server, **bias, **fmt)
    assert joined(chunks, "reasoning_content") == thought
    assert joined(chunks, "content") == whole["message"]["content"]
    for c in chunks:
        for key in ("content", "reasoning_content"):
            assert "think>" not in (c["choices"][0]["delta"].get(key) or "") if c["choices"] else True


def test_deepseek_r1_without_an_end_is_all_reasoning_streamed_or_not(server, parser):
    free = chat(server, max_tokens=20)["choices"][0]["message"]["content"]
    parser("deepseek_r1")
    message = chat(server, max_tokens=20)["choices"][0]["message"]
    assert message["reasoning_content"] == free and message["content"] is None
    chunks = chat_stream(server, max_tokens=20)
    assert joined(chunks, "reasoning_content") == free and joined(chunks, "content") == ""
    hidden = chat(server, max_tokens=20, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in hidden


def test_qwen3_follows_the_prompt_and_chat_template_kwargs(server, parser):
    plain = chat(server, max_tokens=16)["choices"][0]["message"]["content"]
    opened = chat(server, max_tokens=16, chat_template_kwargs={"open_think": True})["choices"][0]["message"]
    closed = chat(server, max_tokens=16, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    parser("qwen3")
    assert chat(server, max_tokens=16)["choices"][0]["message"] == {"role": "assistant", "content": plain}
    split = chat(server, max_tokens=16, chat_template_kwargs={"open_think": True})["choices"][0]["message"]
    assert split == {"role": "assistant", "content": None, "reasoning_content": opened["content"]}
    after = chat(server, max_tokens=16, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert after == closed and "reasoning_content" not in after


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(server, parser, folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    for extra, variables in (
        ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
        ({"chat_template_kwargs": {"open_think": True}}, {"open_think": True}),
        ({}, {}),
    ):
        usage = chat(server, max_tokens=1, **extra)["usage"]
        rendered = hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, **variables)
        assert usage["prompt_tokens"] == len(hf.encode(rendered, add_special_tokens=False)), extra


def test_tool_calls_come_after_the_reasoning(server, parser, folder):
    ids = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    parser("deepseek_r1")
    body = {"logit_bias": {str(ids[END]): BIAS}, "max_tokens": 40, "tools": [tool], "tool_choice": "required"}
    body["parallel_tool_calls"] = False
    choice = chat(server, **body)["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"], choice
    (call,) = message["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    chunks = chat_stream(server, **body)
    assert joined(chunks, "reasoning_content") == message["reasoning_content"]


def test_strict_fields_take_the_reasoning_fields(server, parser):
    """--strict-fields refuses unknown fields, and takes the reasoning fields (chat's own properties) on
    the chat path and on the Messages and Responses APIs that map onto it."""
    from tokenmill.server.protocol import RequestCaps

    loose = server.server.limits
    server.server.limits = dataclasses.replace(loose, strict_fields=True)
    try:
        parser("qwen3")
        fields = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
        message = chat(server, max_tokens=4, include_reasoning=False, **fields)["choices"][0]["message"]
        assert "reasoning_content" not in message
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": ASK, "bogus": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus", r.text
        anthropic = {"model": "tiny", "max_tokens": 4, "messages": ASK, "thinking": {"type": "disabled"}}
        anthropic["output_config"] = {"effort": "low"}
        responses = {"input": "hi", "max_output_tokens": 4, "reasoning": {"effort": "low"}}
        for path, body in (("/v1/messages", anthropic), ("/v1/responses", responses)):
            r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
    finally:
        server.server.limits = loose
    assert isinstance(loose, RequestCaps) and not loose.strict_fields


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
    ],
)
def test_bad_reasoning_fields_are_400s_naming_them(server, parser, body, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_flag_takes_the_two_parsers_only():
    from tokenmill.server.settings import ServeSettings

    assert ServeSettings(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    assert ServeSettings().reasoning_parser is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServeSettings(reasoning_parser="granite")
