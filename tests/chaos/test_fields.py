"""Issue 42's request-field items, at the protocol level (no model, no server):

- 4: every cap of `RequestCaps` refuses one past it with a 400 naming the field and the limit, and accepts
  the limit itself; `tokenmill serve`'s flags default to `RequestCaps`' values;
- 7: unknown field names from ever new requests grow neither the remembered set nor the log lines;
- 8: JSON nested 5,000 deep in any field is a 400 naming the field (or stays text where it is text);
- 13: a tool message with `content: null` is accepted (chat and /tokenize), a blank spec is refused
  and /openapi.json says so, and /openapi.json states every cap; requests generated from
  /openapi.json (schemathesis, with the compat hooks' formats) parse, except the documented rules
  JSON Schema cannot state.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import random
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.server.app import create_app
from tokenmill.server.caps import json_depth, parse_json, text_depth
from tokenmill.server.chat_protocol import conversation, parse_chat_request
from tokenmill.server.openapi import GRAMMAR, JSON_SCHEMA_TEXT, REGEX
from tokenmill.server.protocol import RequestCaps, RequestError, parse_completion_request, parse_model
from tokenmill.server.serving import Server
from tokenmill.server.tokenize import TokenizeRequest
from tokenmill.server.tools import NamedToolChoice, ToolMode, ToolParam
from tokenmill.server.validation import MAX_LOGGED_NAME, MAX_WARNED_FIELDS, ignored_fields_warning

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "x", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **fields}


def tool(i: int, parameters: Any = None, name: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name or f"f{i}"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def parse(body: dict[str, Any], limits: RequestCaps) -> Any:
    return (parse_chat_request if "messages" in body else parse_completion_request)(body, limits)


def refusal(body: dict[str, Any], limits: RequestCaps) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body, limits)
    assert info.value.status == 400
    return info.value


def deep_dict(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


# ------------------------------------------------------------------------------------------ item 4


# (RequestCaps field, a body at `k`, the field the refusal names); each is tried at k = limit and limit + 1
CAPS = [
    ("max_prompts", lambda k: completion(prompt=["a"] * k), "prompt"),
    ("max_prompts", lambda k: completion(prompt=[[1, 2]] * k), "prompt"),
    ("max_choices", lambda k: completion(prompt=["a"], n=k), "n"),
    ("max_stop", lambda k: completion(stop=["s"] * k), "stop"),
    ("max_stop_token_ids", lambda k: completion(stop_token_ids=[1] * k), "stop_token_ids"),
    ("max_allowed_token_ids", lambda k: chat(allowed_token_ids=[1] * k), "allowed_token_ids"),
    ("max_logit_bias", lambda k: completion(logit_bias={str(i): 1 for i in range(k)}), "logit_bias"),
    ("max_bad_words", lambda k: chat(bad_words=["w"] * k), "bad_words"),
    ("max_bad_words_chars", lambda k: completion(bad_words=["a" * (k - 2), "bc"]), "bad_words"),
    ("max_tools", lambda k: chat(tools=[tool(i) for i in range(k)]), "tools"),
    ("max_schema_chars", lambda k: completion(guided_regex="a" * k), "guided_regex"),
    ("max_schema_chars", lambda k: chat(guided_grammar="s" * k), "guided_grammar"),
    ("max_schema_chars", lambda k: completion(guided_choice=["a" * (k - 8), "b"]), "guided_choice"),
    ("max_schema_chars", lambda k: completion(guided_json={"a": "x" * (k - 8)}), "guided_json"),
    ("max_schema_chars", lambda k: completion(structured_outputs={"regex": "a" * k}), "structured_outputs.regex"),
    (
        "max_schema_chars",
        lambda k: chat(tools=[tool(0), tool(1, {"d": "x" * (k - 8)})]),
        "tools[1].function.parameters",
    ),
    ("max_schema_depth", lambda k: completion(guided_json=deep_dict(k)), "guided_json"),
    ("max_schema_depth", lambda k: completion(guided_json=json.dumps(deep_dict(k))), "guided_json"),
    ("max_schema_depth", lambda k: chat(tools=[tool(0, deep_dict(k))]), "tools[0].function.parameters"),
    (
        "max_schema_depth",
        lambda k: chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": deep_dict(k)}}),
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("cap", "body", "param"), CAPS, ids=[f"{c}-{p}" for c, _, p in CAPS])
def test_each_cap_refuses_one_past_it_naming_the_field_and_the_limit(cap, body, param):
    limit = 12
    limits = RequestCaps(**{cap: limit, "max_n": 64})
    parse(body(limit), limits)  # the limit itself is fine
    error = refusal(body(limit + 1), limits)
    assert error.param == param and error.code == "invalid_value", error
    assert f"({limit} levels)" in error.message if cap == "max_schema_depth" else f"at most {limit}." in error.message


def test_the_tools_together_are_capped():
    limits = RequestCaps(max_tools_chars=400)
    parse(chat(tools=[tool(i) for i in range(8)]), limits)
    error = refusal(chat(tools=[tool(i) for i in range(16)]), limits)
    assert error.param == "tools" and "characters of JSON in all" in error.message


def test_n_times_prompts_is_capped_by_default():
    parse(completion(prompt=["a"] * 16, n=8), RequestCaps(max_n=16))  # 128 sequences: the default cap
    error = refusal(completion(prompt=["a"] * 16, n=9), RequestCaps(max_n=16))
    assert error.param == "n" and "144 sequences" in error.message


def test_defaults_bound_what_issue_42_sent():
    """The defaults refuse what item 4 measured (50,000 bad words, 300 prompts) and accept what OpenAI
    clients send (OpenAI's own limits: 4 stop strings, 300 logit_bias entries, 128 tools)."""
    limits = RequestCaps()
    assert refusal(completion(bad_words=[f"w{i}" for i in range(50_000)]), limits).param == "bad_words"
    assert refusal(completion(prompt=["x"] * 300), limits).param == "prompt"
    assert refusal(completion(stop_token_ids=[1] * 60_000), limits).param == "stop_token_ids"
    assert refusal(completion(allowed_token_ids=[1] * 100_000), limits).param == "allowed_token_ids"
    parse(completion(stop=["a", "b", "c", "d"], logit_bias={str(i): -100 for i in range(300)}), limits)
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    parse(chat(tools=[tool(i, schema) for i in range(128)]), limits)


def test_serve_flags_default_to_the_limits():
    from tokenmill.server.settings import CAPS, ServeSettings

    settings, limits = ServeSettings(), RequestCaps()
    limit_fields = {f.name for f in dataclasses.fields(RequestCaps)}
    assert set(CAPS) <= limit_fields
    caps = {f.name for f in dataclasses.fields(RequestCaps)} - {
        "max_n",
        "max_tokens",
        "max_prompt_tokens",
        "strict_fields",
    }
    assert set(CAPS) == caps  # every cap has its flag
    for name in CAPS:
        assert getattr(settings, name) == getattr(limits, name), name


# ------------------------------------------------------------------------------------------ item 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(guided_json=deep_dict(5000)), "guided_json"),
        (completion(guided_json={"enum": deep_list(5000)}), "guided_json"),
        (completion(guided_json="[" * 5000 + "]" * 5000), "guided_json"),
        (completion(structured_outputs={"json": deep_dict(5000)}), "structured_outputs.json"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": deep_dict(5000)}}), None),
        (chat(tools=[tool(0), tool(1, deep_dict(5000))], tool_choice="required"), "tools[1].function.parameters"),
        (completion(stop_token_ids=deep_list(5000)), "stop_token_ids"),
        (completion(prompt=deep_list(5000)), "prompt"),
        (completion(seed=deep_list(5000)), "seed"),
        (completion(stop=deep_list(5000)), "stop"),
        (completion(logit_bias=deep_dict(5000)), "logit_bias.a"),
        (chat(messages=[{"role": "user", "content": deep_list(5000)}]), "messages[0].content"),
    ],
)
def test_json_nested_5000_deep_is_a_400_naming_its_field(body, param):
    error = refusal(body, RequestCaps())
    assert error.param.startswith(param or "response_format.json_schema.schema"), error


def test_depth_is_measured_without_recursion():
    assert json_depth(deep_dict(100_000), 64) == 65  # stops counting past the limit
    assert json_depth({"a": [1, {"b": []}], "c": "[[["}, 64) == 4
    assert text_depth('{"a": "[[[[", "b": [{"c": "]"}]}') == 3
    assert text_depth("[" * 100_000) == 100_000
    with pytest.raises(ValueError):
        parse_json("[" * 5000 + "]" * 5000)


def test_deep_tool_call_arguments_stay_text():
    """An earlier call's arguments too deep to parse reach the chat template as text (a RecursionError
    before, on chat and /tokenize), as arguments that are not JSON do."""
    args = "[" * 3000 + "]" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1"}]
    messages[-1]["content"] = "ok"
    request = parse_chat_request(chat(messages=messages), RequestCaps())
    assert conversation(request.messages)[1]["tool_calls"][0]["function"]["arguments"] == args
    tokenize = parse_model(TokenizeRequest, {"messages": messages})
    assert conversation(tokenize.messages)[1]["tool_calls"][0]["function"]["arguments"] == args


def test_a_model_answer_nested_too_deep_stays_text():
    tools = (ToolParam.model_validate(tool(0)),)
    deep = "[" * 3000 + "]" * 3000
    assert ToolMode("required", tools).answer(deep, "stop") == (deep, [], "stop")
    # a block that opens as a call is one (as streamed): its arguments, read without recursion, as written
    auto = f'<tool_call>{{"name": "f0", "arguments": {deep}}}</tool_call>'
    content, calls, finish = ToolMode("auto", tools).answer(auto, "stop")
    assert (content, [c.function.arguments for c in calls], finish) == (None, [deep], "tool_calls")
    broken = f'<tool_call>{{"arguments": {deep}, "name": "f0"}}</tool_call>'  # (another order: parsed whole)
    assert ToolMode("auto", tools).answer(broken, "stop") == (broken, [], "stop")
    content, calls, _ = ToolMode("named", tools, "f0").answer(deep, "stop")
    assert content is None and calls[0].function.arguments == deep
    assert NamedToolChoice.model_validate({"type": "function", "function": {"name": "f0"}}).function.name == "f0"


# ------------------------------------------------------------------------------------------ item 7


def new_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct names never seen before, 10 to 400 characters long."""
    tag = "".join(rng.choices(string.ascii_letters, k=8))
    return [f"{tag}{i}" + "z" * rng.randint(0, 390) for i in range(count)]


def test_unknown_field_names_grow_neither_memory_nor_log(caplog):
    """Issue 42: 20 requests of 20,000 new unknown names each grew the log by 49 MiB and RSS by 110 MB
    for good. Now the server remembers at most 256 names of at most 64 characters, logs at most 10
    names a line, and nothing once it has remembered 256."""
    server = Server(engine=None, tokenizer=None, model_name="m", max_model_len=16, limits=RequestCaps())  # type: ignore[arg-type]
    rng = random.Random(0)
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        for _ in range(20):
            body = {"prompt": "x", **dict.fromkeys(new_names(rng, 20_000), 1)}
            request = parse_completion_request(body, server.limits)
            assert len(request.ignored_fields) == 20_000
            server.note_ignored(request.ignored_fields)
    assert len(server.warned_fields) == MAX_WARNED_FIELDS
    assert max(map(len, server.warned_fields)) <= MAX_LOGGED_NAME
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and len(lines[0]) < 2000, lines  # the first request filled the set
    assert "and 19990 more" in lines[0] and "later ones are not" in lines[0]


def test_unknown_field_warning_names_each_once():
    warned: set[str] = set()
    first = ignored_fields_warning(["temprature", "x\ny"], warned)
    assert first is not None and "'temprature', 'x\\ny'" in first and "\n" not in first
    assert ignored_fields_warning(["temprature"], warned) is None
    assert ignored_fields_warning(["temprature", "seeed"], warned) == (
        "ignored unknown request fields 'seeed' (send --strict-fields to refuse them)"
    )


# ----------------------------------------------------------------------------------------- item 13


def test_a_tool_answer_may_have_null_content():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": None})
    request = parse_chat_request(chat(messages=messages), RequestCaps())
    assert conversation(request.messages)[2] == {"role": "tool", "content": "", "tool_call_id": "c1"}
    assert conversation(parse_model(TokenizeRequest, {"messages": messages}).messages)[2]["content"] == ""
    for role in ("user", "system", "assistant"):  # still refused where OpenAI refuses it
        error = refusal(chat(messages=[{"role": role, "content": None}]), RequestCaps())
        assert error.param == "messages[0]"


@pytest.mark.parametrize("field", ["guided_grammar", "guided_regex", "guided_json"])
@pytest.mark.parametrize("value", ["", "  \n"])
def test_a_blank_spec_is_refused_and_the_schema_says_so(field, value, openapi):
    assert refusal(completion(**{field: value}), RequestCaps()).param == field
    text = next(o for o in openapi["CompletionRequest"]["properties"][field]["anyOf"] if o["type"] == "string")
    assert text["minLength"] == 1 and text["pattern"] == r"\S"


SCHEMA_LIMITS = RequestCaps(
    max_n=4,
    max_stop=5,
    max_prompts=6,
    max_stop_token_ids=7,
    max_allowed_token_ids=8,
    max_logit_bias=9,
    max_bad_words=10,
    max_tools=11,
    max_schema_chars=1200,
    max_prompt_tokens=13,
)


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    """The request schemas of /openapi.json for a server with SCHEMA_LIMITS (no engine needed)."""
    processor = SimpleNamespace(limits=SimpleNamespace(vocab_size=100))
    server = SimpleNamespace(
        engine=SimpleNamespace(processor=processor), model_name="m", max_model_len=64, limits=SCHEMA_LIMITS
    )
    return create_app(server).openapi()["components"]["schemas"]  # type: ignore[arg-type]


def option(prop: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(o for o in prop.get("anyOf", [prop]) if o.get("type") == kind)


def test_openapi_states_the_caps(openapi):
    limits = SCHEMA_LIMITS
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = openapi[name]["properties"]
        assert option(props["stop"], "array")["maxItems"] == limits.max_stop
        assert option(props["stop_token_ids"], "array")["maxItems"] == limits.max_stop_token_ids
        assert option(props["allowed_token_ids"], "array")["maxItems"] == limits.max_allowed_token_ids
        bias = option(props["logit_bias"], "object")
        assert bias["maxProperties"] == limits.max_logit_bias and bias["propertyNames"]["pattern"] == "^[0-9]{1,10}$"
        assert option(props["bad_words"], "array")["maxItems"] == limits.max_bad_words
        for field, fmt in (("guided_json", JSON_SCHEMA_TEXT), ("guided_regex", REGEX), ("guided_grammar", GRAMMAR)):
            text = option(props[field], "string")
            assert (text["maxLength"], text["format"]) == (limits.max_schema_chars, fmt)
    prompt = openapi["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    arrays = [o for o in prompt if o["type"] == "array"]
    assert [o["maxItems"] for o in arrays] == [limits.max_prompts, limits.max_prompt_tokens, limits.max_prompts]
    assert option(openapi["ChatCompletionRequest"]["properties"]["tools"], "array")["maxItems"] == limits.max_tools
    so = openapi["StructuredOutputsField"]["properties"]
    assert option(so["grammar"], "string")["maxLength"] == limits.max_schema_chars


def test_the_hooks_formats_are_the_schemas_and_every_value_compiles():
    from tokenmill.engine_args import DEMO_MODEL
    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.structured.grammar import GrammarCompiler
    from tokenmill.text.tokenizer import Tokenizer

    hooks = load_hooks()
    assert set(hooks.FORMATS) == {JSON_SCHEMA_TEXT, REGEX, GRAMMAR}
    tokenizer = Tokenizer(str(DEMO_MODEL))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    kinds = {JSON_SCHEMA_TEXT: "json", REGEX: "regex", GRAMMAR: "grammar"}
    for fmt, values in hooks.FORMATS.items():
        for value in values:
            compiler.check(StructuredOutputsParams(**{kinds[fmt]: value}))


def load_hooks() -> Any:
    spec = importlib.util.spec_from_file_location("schemathesis_hooks", ROOT / "compat" / "schemathesis_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers the formats with schemathesis
    return module


# schema-valid requests the server refuses by rules JSON Schema cannot state (compat/schemathesis.toml)
RELATIONAL = {
    ("best_of", "unsupported_field"),  # equal to n
    ("max_tokens", "invalid_value"),  # max_tokens and max_completion_tokens disagree
    ("min_tokens", "invalid_value"),  # more than max_tokens
    ("tool_choice", "invalid_value"),  # a named tool not among the tools
    ("n", "invalid_value"),  # n x prompts
    ("top_logprobs", "invalid_value"),  # chat: without logprobs (left out of the schema: openapi._chat_rules)
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_requests_generated_from_the_schema_are_accepted(openapi, path):
    """What schemathesis's positive_data_acceptance (ST202) checks, without a server: bodies generated
    from /openapi.json parse and turn into sampling parameters, except for the relational rules."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    load_hooks()
    processor = SimpleNamespace(limits=SimpleNamespace(vocab_size=100))
    server = SimpleNamespace(
        engine=SimpleNamespace(processor=processor), model_name="m", max_model_len=64, limits=SCHEMA_LIMITS
    )
    schema = schemathesis.openapi.from_dict(create_app(server).openapi())  # type: ignore[arg-type]
    operation = next(r.ok() for r in schema.get_all_operations() if r.ok().path == path)
    refused: list[tuple[str | None, str | None]] = []

    @given(case=operation.as_strategy())
    @settings(max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        body = case.body
        try:
            if path == "/tokenize":
                parse_model(TokenizeRequest, body)
                return
            request = parse(body, SCHEMA_LIMITS)
            request.to_sampling_params(64, None)
        except RequestError as e:
            assert (e.param, e.code) in RELATIONAL, (e, body)
            refused.append((e.param, e.code))

    check()
    assert len(refused) < 30, refused  # mostly accepted: the schema is not loose
