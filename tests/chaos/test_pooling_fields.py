"""The pooling endpoints' request fields at the protocol level (no model, no server): requests generated
from /openapi.json (schemathesis) parse; /openapi.json states the caps; each cap refuses one past it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.server.app import create_app
from tokenmill.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest, parse_pooling_request
from tokenmill.server.validation import RequestCaps, RequestError

LIMITS = RequestCaps(max_pooling_inputs=5, max_prompt_tokens=13)
KINDS = {"/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest, "/v1/score": ScoreRequest}


def app_schema() -> Any:
    processor = SimpleNamespace(limits=SimpleNamespace(vocab_size=100))
    engine = SimpleNamespace(processor=processor)
    server = SimpleNamespace(engine=engine, model_name="m", max_model_len=64, limits=LIMITS)
    return create_app(server).openapi()  # type: ignore[arg-type]


@pytest.mark.parametrize("path", sorted(KINDS))
def test_requests_generated_from_the_schema_are_accepted(path):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(app_schema())
    operation = next(r.ok() for r in schema.get_all_operations() if r.ok().path == path)

    @given(case=operation.as_strategy())
    @settings(max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        parse_pooling_request(KINDS[path], case.body, LIMITS)  # a RequestError fails the test

    check()


def test_openapi_states_the_caps():
    schemas = app_schema()["components"]["schemas"]
    embed = schemas["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    arrays = {o["items"].get("type") or "strings": o for o in embed if o.get("type") == "array"}
    assert arrays["integer"]["maxItems"] == 13 and arrays["integer"]["items"]["maximum"] == 99
    assert arrays["array"]["maxItems"] == 5 and arrays["array"]["items"]["maxItems"] == 13
    assert schemas["RerankRequest"]["properties"]["documents"]["maxItems"] == 5
    for name in ("text_1", "text_2"):
        option = next(o for o in schemas["ScoreRequest"]["properties"][name]["anyOf"] if o.get("type") == "array")
        assert option["maxItems"] == 5
    assert schemas["EmbeddingRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["m"]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (EmbeddingRequest, {"input": ["a"] * 6}, "input"),
        (RerankRequest, {"query": "q", "documents": ["d"] * 6}, "documents"),
        (ScoreRequest, {"text_1": "q", "text_2": ["d"] * 6}, "text_2"),
        (ScoreRequest, {"text_1": ["q"] * 6, "text_2": "d"}, "text_1"),
    ],
)
def test_each_cap_refuses_one_past_it(kind, body, param):
    with pytest.raises(RequestError) as e:
        parse_pooling_request(kind, body, LIMITS)
    assert e.value.param == param and "at most 5" in e.value.message
    at_cap = {k: (v[:5] if isinstance(v, list) else v) for k, v in body.items()}
    parse_pooling_request(kind, at_cap, LIMITS)


def test_unknown_fields_are_ignored_and_listed_unless_strict():
    req = parse_pooling_request(EmbeddingRequest, {"input": "a", "extra": 1}, LIMITS)
    assert req.ignored_fields == ["extra"]
    with pytest.raises(RequestError) as e:
        parse_pooling_request(EmbeddingRequest, {"input": "a", "extra": 1}, RequestCaps(strict_fields=True))
    assert e.value.param == "extra"
