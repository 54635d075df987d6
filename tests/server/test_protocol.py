"""The OpenAI wire format: requests parse with OpenAI's defaults and map onto SamplingParams field by
field; every bad input is a 400 in OpenAI's error shape naming the parameter; response models dump to
exactly OpenAI's keys; the logprob builders. No model, no server."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from pydantic import BaseModel

from tokenmill.engine.request_checks import EngineLimits, RequestChecker
from tokenmill.errors import ParamError
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.chat_protocol import ChatCompletionRequest, parse_chat_request
from tokenmill.server.protocol import (
    CompletionRequest,
    RequestCaps,
    RequestError,
    check_prompt_cap,
    parse_completion_request,
)
from tokenmill.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    usage_info,
)
from tokenmill.server.validation import refusal

LIMITS = RequestCaps(strict_fields=True)  # the tables below expect unknown fields refused; the default ignores them
MESSAGES = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **fields}


def parse(endpoint: str, raw: Any, limits: RequestCaps = LIMITS) -> CompletionRequest | ChatCompletionRequest:
    return parse_completion_request(raw, limits) if endpoint == "completion" else parse_chat_request(raw, limits)


def body(endpoint: str, **fields: Any) -> dict[str, Any]:
    return completion(**fields) if endpoint == "completion" else chat(**fields)


def rejected(endpoint: str, raw: Any, limits: RequestCaps = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(endpoint, raw, limits)
    error = info.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    if error.param is not None:
        assert error.param in error.message
    return error


ENDPOINTS = pytest.mark.parametrize("endpoint", ["completion", "chat"])

# ---------------------------------------------------------------------------------------- valid requests


def test_minimal_completion_has_openai_defaults() -> None:
    request = parse_completion_request(completion(), LIMITS)
    assert request.model == "m" and request.prompt == "Hello"
    assert request.max_tokens == 16
    assert (request.temperature, request.top_p, request.n) == (1.0, 1.0, 1)
    assert (request.presence_penalty, request.frequency_penalty, request.repetition_penalty) == (0.0, 0.0, 1.0)
    assert request.top_k is None and request.min_p == 0.0
    assert request.stop is None and request.seed is None and request.logprobs is None
    assert not request.echo and not request.stream and request.stream_options is None
    assert not request.ignore_eos and request.skip_special_tokens and not request.include_stop_str_in_output
    assert request.stop_token_ids == [] and request.user is None
    assert request.to_sampling_params(max_model_len=128, default_max_tokens=None) == SamplingParams(max_tokens=16)


def test_minimal_chat_has_openai_defaults() -> None:
    request = parse_chat_request(chat(), LIMITS)
    assert request.max_tokens is None and request.max_completion_tokens is None
    assert request.logprobs is False and request.top_logprobs is None
    assert request.add_generation_prompt is True
    assert request.conversation() == [{"role": "user", "content": "Hi"}]
    assert request.to_sampling_params(128, None) == SamplingParams(max_tokens=None)
    assert request.to_sampling_params(128, 50).max_tokens == 50
    assert request.to_sampling_params(128, 1000).max_tokens == 128  # the server default is capped by the model


def all_changed(params: SamplingParams, skip: set[str]) -> None:
    """Every SamplingParams field (but `skip`) differs from its default: the test exercised its mapping."""
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name not in skip | {"extra"}:
            assert getattr(params, f.name) != getattr(defaults, f.name), f.name


FULL = {
    "n": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 7,
    "stop": ["\n\n", "END"],
    "stop_token_ids": [2, 3],
    "ignore_eos": True,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "user": "someone",
    "min_tokens": 2,
    "logit_bias": {"5": -100, "7": 2.5},
    "allowed_token_ids": [5, 7, 9],
    "bad_words": ["foo", "bar baz"],
    "guided_regex": "[a-z]+",
}
FULL_EXPECTED = {
    **FULL,
    "stop": ("\n\n", "END"),
    "stop_token_ids": (2, 3),
    "logit_bias": {5: -100, 7: 2.5},
    "allowed_token_ids": (5, 7, 9),
    "bad_words": ("foo", "bar baz"),
    "structured_outputs": StructuredOutputsParams(regex="[a-z]+"),
}
del FULL_EXPECTED["user"], FULL_EXPECTED["guided_regex"]


def test_completion_maps_every_field() -> None:
    request = parse_completion_request(completion(**FULL, max_tokens=20, logprobs=3, echo=True), LIMITS)
    params = request.to_sampling_params(max_model_len=128, default_max_tokens=None)
    assert params == SamplingParams(**FULL_EXPECTED, max_tokens=20, logprobs=3, prompt_logprobs=3)
    all_changed(params, skip={"bad_words_token_ids"})  # the engine's front end fills it in
    no_echo = parse_completion_request(completion(logprobs=2), LIMITS).to_sampling_params(128, None)
    assert (no_echo.logprobs, no_echo.prompt_logprobs) == (2, None)
    echo_only = parse_completion_request(completion(echo=True), LIMITS).to_sampling_params(128, None)
    assert (echo_only.logprobs, echo_only.prompt_logprobs) == (None, None)


def test_chat_maps_every_field() -> None:
    raw = chat(**FULL, max_completion_tokens=20, logprobs=True, top_logprobs=4)
    params = parse_chat_request(raw, LIMITS).to_sampling_params(max_model_len=128, default_max_tokens=None)
    assert params == SamplingParams(**FULL_EXPECTED, max_tokens=20, logprobs=4)
    all_changed(params, skip={"prompt_logprobs", "bad_words_token_ids"})  # chat has no echo
    assert parse_chat_request(chat(logprobs=True), LIMITS).to_sampling_params(128, None).logprobs == 0
    assert parse_chat_request(chat(logprobs=False), LIMITS).to_sampling_params(128, None).logprobs is None
    assert parse_chat_request(chat(max_tokens=9), LIMITS).to_sampling_params(128, None).max_tokens == 9
    both = chat(max_tokens=9, max_completion_tokens=9)
    assert parse_chat_request(both, LIMITS).to_sampling_params(128, None).max_tokens == 9


@ENDPOINTS
@pytest.mark.parametrize("value", [-1, 0, None])
def test_top_k_no_limit_spellings(endpoint: str, value: int | None) -> None:
    assert parse(endpoint, body(endpoint, top_k=value)).top_k is None


@ENDPOINTS
def test_null_means_default(endpoint: str) -> None:
    nulls = dict.fromkeys(["temperature", "top_p", "n", "presence_penalty", "stream", "stop", "seed", "user"])
    request = parse(endpoint, body(endpoint, **nulls))
    assert (request.temperature, request.top_p, request.n, request.stream) == (1.0, 1.0, 1, False)
    assert request.to_sampling_params(128, None) == parse(endpoint, body(endpoint)).to_sampling_params(128, None)


def test_completion_null_max_tokens_means_server_default() -> None:
    request = parse_completion_request(completion(max_tokens=None), LIMITS)
    assert request.to_sampling_params(128, None).max_tokens is None
    assert request.to_sampling_params(128, 64).max_tokens == 64


def test_ints_are_accepted_for_floats() -> None:
    request = parse_completion_request(completion(temperature=1, top_p=1, presence_penalty=-2), LIMITS)
    assert request.to_sampling_params(128, None).temperature == 1.0


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 0], [[1, 2, 0]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: Any, prompts: list[Any]) -> None:
    assert parse_completion_request(completion(prompt=prompt), LIMITS).prompts() == prompts


def test_chat_messages() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"},
        {"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None, "tool_call_id": None},
        {"role": "user", "content": "", "tool_calls": [], "annotations": []},
    ]
    request = parse_chat_request(chat(messages=messages, add_generation_prompt=False), LIMITS)
    assert request.messages[2].text == "a\nb"
    assert request.add_generation_prompt is False
    assert request.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": ""},
    ]


@ENDPOINTS
def test_stream_options(endpoint: str) -> None:
    request = parse(endpoint, body(endpoint, stream=True, stream_options={"include_usage": True}))
    assert request.stream and request.stream_options is not None and request.stream_options.include_usage
    assert parse(endpoint, body(endpoint, stream=False, stream_options=None)).stream_options is None


# ---------------------------------------------------------------------------------------- bad requests

BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (endpoint, fields, param, code)
    ("both", {"temperature": "hot"}, "temperature", "invalid_type"),
    ("both", {"temperature": "1.0"}, "temperature", "invalid_type"),
    ("both", {"temperature": math.nan}, "temperature", "invalid_value"),
    ("both", {"n": "2"}, "n", "invalid_type"),
    ("both", {"n": True}, "n", "invalid_type"),
    ("both", {"n": 1.5}, "n", "invalid_type"),
    ("both", {"seed": 1.5}, "seed", "invalid_type"),
    ("both", {"stream": "yes"}, "stream", "invalid_type"),
    ("both", {"model": 5}, "model", "invalid_type"),
    ("both", {"top_p": 0}, "top_p", "invalid_value"),
    ("both", {"top_p": 1.5}, "top_p", "invalid_value"),
    ("both", {"n": 0}, "n", "invalid_value"),
    ("both", {"temperature": 2.5}, "temperature", "invalid_value"),
    ("both", {"temperature": -0.1}, "temperature", "invalid_value"),
    ("both", {"min_p": 1.5}, "min_p", "invalid_value"),
    ("both", {"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ("both", {"frequency_penalty": -2.5}, "frequency_penalty", "invalid_value"),
    ("both", {"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ("both", {"top_k": -2}, "top_k", "invalid_value"),
    ("both", {"top_k": 1.5}, "top_k", "invalid_type"),
    ("both", {"stop": ""}, "stop", "invalid_value"),
    ("both", {"stop": []}, "stop", "invalid_value"),
    ("both", {"stop": 5}, "stop", "invalid_value"),
    ("both", {"stop": ["a", ""]}, "stop[1]", "invalid_value"),
    ("both", {"stop_token_ids": [1, -1]}, "stop_token_ids[1]", "invalid_value"),
    ("both", {"stop_token_ids": "1"}, "stop_token_ids", "invalid_type"),
    ("both", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("both", {"stream": False, "stream_options": {}}, "stream_options", "invalid_value"),
    (
        "both",
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
        "invalid_type",
    ),
    ("both", {"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown_field"),
    ("both", {"temprature": 0.5}, "temprature", "unknown_field"),
    ("both", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("both", {"max_tokens": "16"}, "max_tokens", "invalid_type"),
    ("completion", {"logprobs": 21}, "logprobs", "invalid_value"),
    ("completion", {"logprobs": -1}, "logprobs", "invalid_value"),
    ("completion", {"logprobs": True}, "logprobs", "invalid_type"),
    ("completion", {"echo": 1}, "echo", "invalid_type"),
    ("completion", {"prompt": ""}, "prompt", "invalid_value"),
    ("completion", {"prompt": []}, "prompt", "invalid_value"),
    ("completion", {"prompt": [[]]}, "prompt[0]", "invalid_value"),
    ("completion", {"prompt": ["a", ""]}, "prompt[1]", "invalid_value"),
    ("completion", {"prompt": [1, -1]}, "prompt[1]", "invalid_value"),
    ("completion", {"prompt": [1, "a"]}, "prompt[1]", "invalid_value"),
    ("completion", {"prompt": [1.5]}, "prompt", "invalid_value"),
    ("completion", {"prompt": [[1], [2, True]]}, "prompt[1][1]", "invalid_value"),
    ("completion", {"prompt": {"text": "a"}}, "prompt", "invalid_value"),
    ("completion", {"max_completion_tokens": 5}, "max_completion_tokens", "unknown_field"),
    ("chat", {"messages": []}, "messages", "invalid_value"),
    ("chat", {"messages": "hi"}, "messages", "invalid_type"),
    ("chat", {"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "invalid_value"),  # no tool_call_id
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0]", "invalid_value"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
        "unsupported_content",
    ),
    (
        "chat",
        {
            "messages": [
                MESSAGES[0],
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]},
            ]
        },
        "messages[1].content",
        "unsupported_content",
    ),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo", "unknown_field"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name", "invalid_type"),
    (
        "chat",
        {"messages": [{**MESSAGES[0], "tool_calls": [{}]}]},
        "messages[0].tool_calls[0].id",
        "missing_required_parameter",
    ),
    ("chat", {"messages": [{**MESSAGES[0], "tool_call_id": "c1"}]}, "messages[0]", "invalid_value"),  # a user's
    ("chat", {"messages": [{**MESSAGES[0], "refusal": "no"}]}, "messages[0].refusal", "unsupported_field"),
    ("chat", {"logprobs": 2}, "logprobs", "invalid_type"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ("chat", {"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "invalid_value"),
    ("chat", {"add_generation_prompt": "true"}, "add_generation_prompt", "invalid_type"),
    ("chat", {"echo": True}, "echo", "unknown_field"),
]


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "code"),
    [
        pytest.param(e, f, p, c, id=f"{e}-{p}-{json.dumps(f)[:40]}")
        for endpoint, f, p, c in BAD
        for e in (["completion", "chat"] if endpoint == "both" else [endpoint])
    ],
)
def test_bad_values_name_the_param(endpoint: str, fields: dict[str, Any], param: str, code: str) -> None:
    error = rejected(endpoint, body(endpoint, **fields))
    assert (error.param, error.code) == (param, code), error.message


@ENDPOINTS
def test_missing_required(endpoint: str) -> None:
    raw = body(endpoint)
    name = "prompt" if endpoint == "completion" else "messages"
    del raw[name]
    error = rejected(endpoint, raw)
    assert (error.param, error.code) == (name, "missing_required_parameter")


UNSUPPORTED: list[tuple[str, Any, list[Any]]] = [
    # (field, a value that needs support, values that mean "not used")
    ("functions", [{"name": "f"}], [None]),
    ("function_call", "auto", [None]),
    ("suffix", "end", [None, ""]),
    ("best_of", 2, [None, 1]),
    ("audio", {"voice": "alloy", "format": "wav"}, [None]),
    ("modalities", ["text", "audio"], [None, ["text"]]),
    ("prediction", {"type": "content", "content": "x"}, [None]),
    ("web_search_options", {}, [None]),
    ("store", True, [None, False]),
    ("metadata", {"k": "v"}, [None, {}]),
    ("service_tier", "flex", [None, "auto", "default"]),
]


@ENDPOINTS
@pytest.mark.parametrize(("field", "value", "defaults"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_fields(endpoint: str, field: str, value: Any, defaults: list[Any]) -> None:
    error = rejected(endpoint, body(endpoint, **{field: value}))
    assert (error.param, error.code) == (field, "unsupported_field")
    assert "not supported" in error.message
    for default in defaults:
        request = parse(endpoint, body(endpoint, **{field: default}))
        assert field not in request.model_dump()


COMPLETION_ONLY = [  # tools are a chat request's (tests/server/test_structured_server.py); a completion refuses them
    ("tools", [{"type": "function", "function": {"name": "f"}}], [None]),
    ("tool_choice", "auto", [None]),
    ("parallel_tool_calls", True, [None]),
    ("reasoning_effort", "low", [None]),  # (chat gives it to the template: tests/server/test_reasoning.py)
]


@pytest.mark.parametrize(("field", "value", "defaults"), COMPLETION_ONLY, ids=[u[0] for u in COMPLETION_ONLY])
def test_tool_fields_are_refused_on_completions(field: str, value: Any, defaults: list[Any]) -> None:
    test_unsupported_fields("completion", field, value, defaults)


@ENDPOINTS
def test_best_of_equal_to_n_is_accepted(endpoint: str) -> None:
    assert parse(endpoint, body(endpoint, n=3, best_of=3)).n == 3
    assert rejected(endpoint, body(endpoint, n=3, best_of=True)).param == "best_of"


@ENDPOINTS
@pytest.mark.parametrize("raw", [[1], 3, "text", None, True])
def test_body_must_be_an_object(endpoint: str, raw: Any) -> None:
    error = rejected(endpoint, raw)
    assert error.param is None and "JSON object" in error.message


def test_limits() -> None:
    limits = RequestCaps(max_n=4, max_tokens=100, max_prompt_tokens=3, max_stop=2)
    assert rejected("completion", completion(n=5), limits).param == "n"
    assert rejected("chat", chat(n=5), limits).param == "n"
    assert parse_chat_request(chat(n=4), limits).n == 4
    assert rejected("completion", completion(max_tokens=101), limits).param == "max_tokens"
    assert rejected("chat", chat(max_tokens=101), limits).param == "max_tokens"
    assert rejected("chat", chat(max_completion_tokens=101), limits).param == "max_completion_tokens"
    assert parse_completion_request(completion(max_tokens=100), limits).max_tokens == 100
    assert rejected("chat", chat(stop=["a", "b", "c"]), limits).param == "stop"
    assert rejected("completion", completion(prompt=[1, 2, 3, 4]), limits).param == "prompt"
    assert rejected("completion", completion(prompt=[[1], [1, 2, 3, 4]]), limits).param == "prompt[1]"
    assert parse_completion_request(completion(prompt=[1, 2, 3]), limits).prompts() == [[1, 2, 3]]
    assert rejected("completion", completion(n=17), LIMITS).param == "n"  # the default cap
    assert rejected("completion", completion(stop=[str(i) for i in range(17)]), LIMITS).param == "stop"


def test_request_caps() -> None:
    limits = RequestCaps(
        max_prompts=2, max_choices=4, max_logit_bias=1, max_bad_words=1, max_tools=1, max_schema_depth=2
    )
    assert rejected("completion", completion(prompt=["a", "b", "c"]), limits).param == "prompt"
    assert rejected("completion", completion(prompt=["a", "b"], n=3), limits).param == "n"
    assert parse_completion_request(completion(prompt=["a", "b"], n=2), limits).n == 2
    assert rejected("chat", chat(logit_bias={"1": 1, "2": 1}), limits).param == "logit_bias"
    assert rejected("completion", completion(bad_words=["a", "b"]), limits).param == "bad_words"
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]
    assert rejected("chat", chat(tools=tools), limits).param == "tools"
    error = rejected("completion", completion(guided_json={"a": {"b": {}}}), limits)
    assert error.param == "guided_json" and "(2 levels)" in error.message
    assert parse_completion_request(completion(guided_json={"a": {}}), limits).structured_field == "guided_json"


def test_a_tool_message_may_have_null_content() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": None},
    ]
    request = parse_chat_request(chat(messages=messages), LIMITS)
    assert [m.text for m in request.messages] == ["Hi", "", ""]
    assert rejected("chat", chat(messages=[{"role": "user", "content": None}])).param == "messages[0]"


def test_refusals_show_a_bounded_value() -> None:
    huge = list(range(1_000_000))
    error = rejected("completion", completion(n=huge))  # (its repr would be 7 MB)
    assert error.param == "n" and "[0, 1, 2," in error.message and len(error.message) < 200
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    assert rejected("completion", completion(seed=deep)).param == "seed"  # no RecursionError


def test_max_tokens_beyond_the_model() -> None:
    # the engine's front door refuses it; the server names the field the request set it with
    with pytest.raises(RequestError) as info:
        request = parse_completion_request(completion(max_tokens=200), LIMITS)
        through_the_door(request.to_sampling_params(128, None), 1, 128, "prompt", "max_tokens")
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        chat_request = parse_chat_request(chat(max_completion_tokens=200), LIMITS)
        params = chat_request.to_sampling_params(128, None)
        through_the_door(params, 1, 128, "messages", chat_request.max_tokens_param)
    assert info.value.param == "max_completion_tokens"


def test_sampling_params_errors_become_request_errors() -> None:
    # model_construct skips validation: to_sampling_params must still answer with a RequestError
    request = CompletionRequest.model_construct(model="m", prompt="x", temperature=-1.0)
    with pytest.raises(RequestError) as info:
        request.to_sampling_params(128, None)
    assert (info.value.status, info.value.param) == (400, "temperature")
    chat_request = ChatCompletionRequest.model_construct(model="m", messages=[], logprobs=True, top_logprobs=50)
    with pytest.raises(RequestError) as info:
        chat_request.to_sampling_params(128, None)
    assert info.value.param == "top_logprobs"


def through_the_door(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int, param: str, max_tokens_param: str
) -> None:
    """The engine's front door on a prompt of that length, its refusal as the server words it."""
    checker = RequestChecker(None, EngineLimits(max_model_len, 100, 4, 1000, False))  # type: ignore[arg-type]
    try:
        checker.check([1] * num_prompt_tokens, params)
    except ParamError as e:
        raise refusal(e, param, max_tokens_param, None) from None


def check_prompt_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, limits: RequestCaps, param: str
) -> None:
    """The server's cap, then the engine's front door, as the server runs them on a prompt."""
    check_prompt_cap(num_prompt_tokens, limits, param)
    through_the_door(SamplingParams(max_tokens=max_tokens), num_prompt_tokens, max_model_len, param, "max_tokens")


def test_check_prompt_length() -> None:
    check_prompt_length(10, 6, 16, LIMITS, "prompt")
    check_prompt_length(15, None, 16, LIMITS, "messages")
    with pytest.raises(RequestError) as info:
        check_prompt_length(10, 7, 16, LIMITS, "messages")
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    assert info.value.message == (
        "This model's maximum context length is 16 tokens. However, you requested 17 tokens (10 in the messages, "
        "7 in the completion). Please reduce the length of the prompt or the completion."
    )
    with pytest.raises(RequestError) as info:
        check_prompt_length(16, None, 16, LIMITS, "prompt")
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as info:
        check_prompt_length(5, 1, 16, RequestCaps(max_prompt_tokens=4), "prompt")
    assert (info.value.param, info.value.code) == ("prompt", "invalid_value")
    with pytest.raises(RequestError) as info:  # max_tokens alone past the model's length names max_tokens
        check_prompt_length(5, 17, 16, LIMITS, "prompt[1]")
    assert (info.value.param, info.value.code) == ("max_tokens", "invalid_value")
    assert (
        info.value.message == "Invalid value for 'max_tokens': 17 is more than the model's maximum length (16 tokens)."
    )


def test_error_body_is_openais_shape() -> None:
    error = rejected("completion", completion(temperature="hot"))
    assert error.body() == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_type",
        }
    }
    assert ErrorResponse.model_validate(error.body()).error.param == "temperature"
    assert RequestError("x").body() == {
        "error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}
    }


# ------------------------------------------------------------------------------------------- responses

USAGE = UsageInfo(
    prompt_tokens=5, completion_tokens=2, total_tokens=7, prompt_tokens_details=PromptTokensDetails(cached_tokens=4)
)
USAGE_JSON = {
    "prompt_tokens": 5,
    "completion_tokens": 2,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 4},
}


def test_completion_response_json() -> None:
    logprobs = CompletionLogprobs(tokens=["a"], token_logprobs=[-0.5], top_logprobs=[{"a": -0.5}], text_offset=[0])
    response = CompletionResponse(
        id="cmpl-1",
        created=100,
        model="m",
        choices=[CompletionChoice(index=0, text="a", logprobs=logprobs, finish_reason="stop", stop_reason="\n")],
        usage=USAGE,
    )
    assert response.model_dump() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "a",
                "logprobs": {
                    "tokens": ["a"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"a": -0.5}],
                    "text_offset": [0],
                },
                "finish_reason": "stop",
                "stop_reason": "\n",
            }
        ],
        "usage": USAGE_JSON,
    }
    assert json.loads(response.model_dump_json()) == response.model_dump()
    chunk = CompletionStreamResponse(id="cmpl-1", created=100, model="m", choices=[CompletionChoice(index=1, text="b")])
    assert chunk.model_dump() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [{"index": 1, "text": "b", "logprobs": None, "finish_reason": None, "stop_reason": None}],
        "usage": None,
    }


def test_chat_response_json() -> None:
    top = TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])
    logprobs = ChatLogprobs(content=[ChatTokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=[top])])
    response = ChatCompletionResponse(
        id="chatcmpl-1",
        created=100,
        model="m",
        choices=[ChatChoice(index=0, message=ChatMessage(content="Hi"), logprobs=logprobs, finish_reason="length")],
        usage=USAGE,
    )
    top_json = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}
    assert response.model_dump() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "logprobs": {"content": [{**top_json, "top_logprobs": [top_json]}]},
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": USAGE_JSON,
    }


def test_chat_chunks_json() -> None:
    def chunk(delta: DeltaMessage, finish_reason: str | None = None, usage: UsageInfo | None = None) -> dict[str, Any]:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id="c", created=1, model="m", choices=[choice], usage=usage).model_dump()

    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    tail = {"logprobs": None, "stop_reason": None}
    assert chunk(DeltaMessage(role="assistant", content="")) == {
        **head,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, **tail}],
        "usage": None,
    }
    assert chunk(DeltaMessage(content="Hi")) == {
        **head,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, **tail}],
        "usage": None,
    }
    assert chunk(DeltaMessage(), "stop", USAGE) == {
        **head,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", **tail}],
        "usage": USAGE_JSON,
    }
    usage_only = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=USAGE)
    assert json.loads(usage_only.model_dump_json()) == {**head, "choices": [], "usage": USAGE_JSON}


def test_model_list_json() -> None:
    models = ModelList(data=[ModelCard(id="m", created=5, max_model_len=2048)])
    assert models.model_dump() == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 5, "owned_by": "tokenmill", "max_model_len": 2048}],
    }


@pytest.mark.parametrize(
    "model",
    [
        CompletionRequest,
        ChatCompletionRequest,
        CompletionResponse,
        CompletionStreamResponse,
        ChatCompletionResponse,
        ChatCompletionChunk,
        ModelList,
        ErrorResponse,
    ],
)
def test_json_schemas_build(model: type[BaseModel]) -> None:
    for mode in ("validation", "serialization"):
        assert model.model_json_schema(mode=mode)["type"] == "object"


def test_request_schema_documents_nulls_and_no_extras() -> None:
    schema = ChatCompletionRequest.model_json_schema()
    assert schema["additionalProperties"] is False
    assert {"type": "null"} in schema["properties"]["temperature"]["anyOf"]
    assert schema["properties"]["temperature"]["default"] == 1.0
    assert set(schema["required"]) == {"messages"}  # model: absent means the served one


# -------------------------------------------------------------------------------------------- builders

VOCAB = {0: "Hello", 1: " world", 2: "!", 3: "é", 4: "<s>"}


def test_completion_logprobs() -> None:
    entries = [
        TokenLogprob(token_id=0, logprob=-0.25, rank=1, top=[(0, -0.25), (2, -2.0)]),
        TokenLogprob(token_id=1, logprob=-1.5, rank=2, top=[(2, -0.5)]),  # the chosen token is added to the top
        TokenLogprob(token_id=2, logprob=-math.inf, rank=5, top=[]),
    ]
    out = completion_logprobs(entries, VOCAB.__getitem__, text_offset_start=3)
    assert out.model_dump() == {
        "tokens": ["Hello", " world", "!"],
        "token_logprobs": [-0.25, -1.5, -9999.0],
        "top_logprobs": [{"Hello": -0.25, "!": -2.0}, {"!": -0.5, " world": -1.5}, {"!": -9999.0}],
        "text_offset": [3, 8, 14],
    }
    echoed = completion_logprobs([None, entries[1]], VOCAB.__getitem__, 0, token_ids=[4, 1])
    assert echoed.model_dump() == {
        "tokens": ["<s>", " world"],
        "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {"!": -0.5, " world": -1.5}],
        "text_offset": [0, 3],
    }
    with pytest.raises(ValueError, match="token_ids"):
        completion_logprobs([None], VOCAB.__getitem__, 0)


def test_chat_logprobs() -> None:
    entries = [
        TokenLogprob(token_id=3, logprob=-0.1, rank=1, top=[(3, -0.1), (2, -3.0)]),
        TokenLogprob(token_id=2, logprob=-0.2, rank=1, top=[]),
    ]
    assert chat_logprobs(entries, VOCAB.__getitem__).model_dump() == {
        "content": [
            {
                "token": "é",
                "logprob": -0.1,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.1, "bytes": [0xC3, 0xA9]},
                    {"token": "!", "logprob": -3.0, "bytes": [33]},
                ],
            },
            {"token": "!", "logprob": -0.2, "bytes": [33], "top_logprobs": []},
        ]
    }


def test_usage_info() -> None:
    def output(prompt_len: int, lens: list[int], cached: int) -> RequestOutput:
        choices = [CompletionOutput(i, "", [0] * n, None, "stop") for i, n in enumerate(lens)]
        metrics = RequestMetrics(0.0, None, None, None)
        return RequestOutput("r", None, [1] * prompt_len, None, choices, True, metrics, num_cached_tokens=cached)

    usage = usage_info([output(5, [2, 3], 4), output(3, [1, 1], 0)])
    assert usage.model_dump() == {
        "prompt_tokens": 8,
        "completion_tokens": 7,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@ENDPOINTS
def test_unknown_fields_are_ignored_and_listed_unless_strict(endpoint: str) -> None:
    raw = body(endpoint, temprature=0.5, guidellm_extra={"x": 1}, top_p=0.5)
    request = parse(endpoint, raw, RequestCaps())
    assert request.ignored_fields == ["temprature", "guidellm_extra"] and request.top_p == 0.5
    assert parse(endpoint, body(endpoint), RequestCaps()).ignored_fields == []
    error = rejected(endpoint, raw, RequestCaps(strict_fields=True))
    assert (error.param, error.code) == ("temprature", "unknown_field")
    # fields that would change the output if ignored stay refused either way
    error = rejected(endpoint, body(endpoint, functions=[{"name": "f"}]), RequestCaps())
    assert (error.param, error.code) == ("functions", "unsupported_field")


@ENDPOINTS
def test_vllm_extension_fields(endpoint: str) -> None:
    raw = body(endpoint, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    request = parse(endpoint, raw)
    assert request.stream_options is not None and request.stream_options.continuous_usage_stats
    for bad, param in (
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words[0]"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
        ({"logit_bias": {"٣": 1}}, "logit_bias"),  # token ids are ASCII decimal
        ({"logit_bias": {"1" * 11: 1}}, "logit_bias"),
    ):
        assert rejected(endpoint, body(endpoint, **bad)).param == param
    with pytest.raises(RequestError) as info:
        parse(endpoint, body(endpoint, min_tokens=50, max_tokens=10)).to_sampling_params(128, None)
    assert info.value.param == "min_tokens" and "max_tokens" in info.value.message


def test_integral_numbers_are_integers_as_json_schema_says() -> None:
    request = parse_completion_request(completion(n=2.0, prompt=[[1.0, 2], [3.0]], max_tokens=8.0, seed=-3.0), LIMITS)
    assert (request.n, request.prompts(), request.max_tokens, request.seed) == (2, [[1, 2], [3]], 8, -3)
    assert all(type(t) is int for p in request.prompts() for t in p)
