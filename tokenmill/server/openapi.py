"""`/openapi.json` that tells the truth: the constraints the validators enforce, written into the
request schemas where JSON Schema can say them, so that a schema-driven client or fuzzer never sends
a "valid" request that the server then refuses.

- `model` is the served model's name (an enum of one), or absent / null for it;
- `stream_options` only with `stream: true`, and (chat) `top_logprobs` only with `logprobs: true`;
- `n` and `max_tokens` within the server's limits and the model's length, token ids within the
  vocabulary;
- `/tokenize` takes exactly one of `prompt` or `messages`;
- unknown fields are allowed (ignored) unless the server is strict about fields.
Relations JSON Schema cannot state (prompt + max_tokens within the model's length, `min_tokens` at most
`max_tokens`, token ids within the vocabulary) stay 400s documented in the README.
"""

from __future__ import annotations

from typing import Any


def _unset_or(name: str, values: list[Any]) -> dict[str, Any]:
    """The field is absent, or one of `values`."""
    return {"anyOf": [{"not": {"required": [name]}}, {"properties": {name: {"enum": values}}, "required": [name]}]}


def _only_with(field: str, flag: str) -> dict[str, Any]:
    """`field` must be null or absent unless `flag` is true."""
    return {"if": _unset_or(flag, [False, None]), "then": {"properties": {field: {"type": "null"}}}}


def _cap(prop: dict[str, Any], maximum: int) -> None:
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = maximum


def _cap_token_ids(prop: Any, vocab_size: int) -> None:
    """Every token id (a non-negative integer) anywhere under `prop` is below `vocab_size`."""
    if isinstance(prop, dict):
        if prop.get("type") == "integer" and prop.get("minimum") == 0:
            prop["maximum"] = vocab_size - 1
        for value in prop.values():
            _cap_token_ids(value, vocab_size)
    elif isinstance(prop, list):
        for value in prop:
            _cap_token_ids(value, vocab_size)


def constrain(
    components: dict[str, Any],
    model_name: str,
    max_model_len: int,
    max_n: int,
    max_tokens: int | None,
    strict_fields: bool,
    vocab_size: int,
) -> None:
    """Tighten the request schemas in `components` (in place) to what this server accepts."""
    cap = min(max_model_len, max_tokens) if max_tokens is not None else max_model_len
    for name, rules in (
        ("CompletionRequest", [_only_with("stream_options", "stream")]),
        ("ChatCompletionRequest", [_only_with("stream_options", "stream"), _only_with("top_logprobs", "logprobs")]),
    ):
        schema = components[name]
        props = schema["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}], "title": "Model"}
        _cap(props["n"], max_n)
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if field in props:
                _cap(props[field], cap)
        for field in ("prompt", "stop_token_ids", "allowed_token_ids"):
            if field in props:
                _cap_token_ids(props[field], vocab_size)
        schema["allOf"] = rules
        schema["additionalProperties"] = not strict_fields  # unknown fields are ignored unless strict
    _cap_token_ids(components["DetokenizeRequest"]["properties"]["tokens"], vocab_size)
    tokenize = components["TokenizeRequest"]
    props = tokenize["properties"]
    array = next(o for o in props["messages"]["anyOf"] if o.get("type") == "array")
    tokenize["oneOf"] = [  # exactly one of the two is given (not null)
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": array}},
    ]
