"""/openapi.json's chat request schema and the fuzzer that reads it: the reasoning fields
(`chat_template_kwargs`, `reasoning_effort`, `include_reasoning`) are real properties; the schema and
the parser agree on them with and without --strict-fields (what one accepts the other does); and
schemathesis's canonicalizer still reads the chat schema with room for more properties
(tokenmill/server/openapi.py, `_chat_rules`). No model: the app is built on a stand-in server."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from tokenmill.server.app import create_app
from tokenmill.server.chat_protocol import parse_chat_request
from tokenmill.server.protocol import RequestCaps, RequestError

CHAT = "ChatCompletionRequest"
REASONING = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low", "include_reasoning": False}
BODY = {"messages": [{"role": "user", "content": "hi"}], **REASONING}
ROOM = 20  # properties the chat schema must have room for in the fuzzer's canonicalizer


def openapi(limits: RequestCaps) -> dict[str, Any]:
    processor = SimpleNamespace(limits=SimpleNamespace(vocab_size=100))
    server = SimpleNamespace(
        engine=SimpleNamespace(processor=processor), model_name="m", max_model_len=64, limits=limits
    )
    return create_app(server).openapi()  # type: ignore[arg-type]


def schema_accepts(doc: dict[str, Any], body: dict[str, Any]) -> bool:
    root = {"$ref": f"#/components/schemas/{CHAT}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


def parser_accepts(body: dict[str, Any], limits: RequestCaps) -> bool:
    try:
        parse_chat_request(body, limits)
    except RequestError as e:
        assert e.param == "bogus", e
        return False
    return True


@pytest.mark.parametrize("strict", [False, True])
def test_the_reasoning_fields_are_properties_and_the_schema_agrees_with_the_parser(strict):
    limits = RequestCaps(strict_fields=strict)
    doc = openapi(limits)
    chat = doc["components"]["schemas"][CHAT]
    assert chat["additionalProperties"] is not strict
    props = chat["properties"]
    assert set(REASONING) <= set(props)
    assert {"type": "object", "additionalProperties": True} in props["chat_template_kwargs"]["anyOf"]
    assert props["reasoning_effort"]["anyOf"][0]["enum"] == ["none", "minimal", "low", "medium", "high"]
    assert {"type": "boolean"} in props["include_reasoning"]["anyOf"]
    assert schema_accepts(doc, BODY) and parser_accepts(BODY, limits)
    request = parse_chat_request(BODY, limits)
    assert request.template_variables() == {"reasoning_effort": "low", "enable_thinking": False}
    assert request.include_reasoning is False
    unknown = {**BODY, "bogus": 1}  # ignored unless strict, by both
    assert schema_accepts(doc, unknown) is parser_accepts(unknown, limits) is (not strict)
    for bad in ({"reasoning_effort": "max"}, {"include_reasoning": "yes"}, {"chat_template_kwargs": "x"}):
        assert not schema_accepts(doc, {**BODY, **bad})
        with pytest.raises(RequestError) as info:
            parse_chat_request({**BODY, **bad}, limits)
        assert info.value.param == next(iter(bad))


def reasoning_fields_drawn(doc: dict[str, Any]) -> set[str]:
    """The reasoning fields in bodies schemathesis draws for the chat operation of `doc` (raising its
    UnsupportedSchema where its canonicalizer gives up on the schema)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    operations = [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]
    (operation,) = [o for o in operations if o.path == "/v1/chat/completions"]
    seen: set[str] = set()

    @given(case=operation.as_strategy())
    @settings(max_examples=100, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def draw(case: Any) -> None:
        seen.update(set(case.body) & set(REASONING))

    draw()
    return seen


@pytest.mark.slow  # ~7 s (200 drawn bodies); guards the fuzzer's run, which is slow too (test_server.py)
def test_the_chat_schema_leaves_the_fuzzer_room():
    """schemathesis builds a strategy for the chat operation with ROOM more properties (it declines the
    whole operation once its canonicalizer's budget runs out: openapi._chat_rules), and what it draws
    carries the reasoning fields at times."""
    doc = openapi(RequestCaps())
    grown = copy.deepcopy(doc)
    for i in range(ROOM):
        grown["components"]["schemas"][CHAT]["properties"][f"extra_{i}"] = {"type": "boolean"}
    assert reasoning_fields_drawn(doc)
    assert reasoning_fields_drawn(grown)


def test_strict_fields_change_only_additional_properties():
    loose, strict = openapi(RequestCaps()), openapi(RequestCaps(strict_fields=True))
    for doc in (loose, strict):
        doc["components"]["schemas"][CHAT].pop("additionalProperties")
    assert loose["components"]["schemas"][CHAT] == strict["components"]["schemas"][CHAT]
