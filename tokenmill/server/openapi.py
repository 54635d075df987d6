"""`/openapi.json` that tells the truth: the constraints the validators enforce, written into the
request schemas where JSON Schema can say them, so that a schema-driven client or fuzzer never sends
a "valid" request that the server then refuses.

- `model` is the served model's name (an enum of one), or absent / null for it;
- `stream_options` only with `stream: true`;
- `n` and `max_tokens` within the server's limits and the model's length, token ids within the
  vocabulary, `logit_bias` keys decimal token ids;
- the caps of `RequestCaps` (caps.py): items of `stop`, `stop_token_ids`, `allowed_token_ids`,
  `bad_words`, `tools` and prompts per request, `logit_bias` entries, the length of a spec given as
  text (`guided_json` / `_regex` / `_grammar`, not blank either, with a `format` naming what it is);
- at most one structured-output field per request, `structured_outputs` asking for one thing,
  `response_format` of type json_schema with a schema; (chat) `tool_choice` "required" or a named
  function only with `tools` and without a structured-output field;
- unsupported OpenAI fields only with their default (validation.py); chat messages as `_roles`
  has them (chat_protocol.py);
- `/tokenize` takes exactly one of `prompt` or `messages`;
- unknown fields are allowed (ignored) unless the server is strict about fields.
Rules JSON Schema cannot state stay 400s naming the field, listed in compat/schemathesis.toml: prompt +
max_tokens within the model's length, `min_tokens` at most `max_tokens`, `logit_bias` ids within the
vocabulary, a named tool among `tools`, `best_of` equal to `n`, `max_tokens` and
`max_completion_tokens` equal when both are given, a spec that does not compile, the sizes and depths
JSON Schema has no word for (n x prompts, characters of all bad words, of all tools, of a schema
object, its nesting) and what a chat template refuses; and one it could state but a fuzzer could then
not read (`_chat_rules`): (chat) `top_logprobs` only with `logprobs: true`.
"""

from __future__ import annotations

from typing import Any

from tokenmill.server.protocol import LOGIT_BIAS_KEY
from tokenmill.server.validation import RequestCaps

NOT_BLANK = r"\S"  # a character other than whitespace (a blank spec is refused)
# `format` of a spec given as text: what it must be, which JSON Schema cannot check (a schema-driven
# fuzzer is given valid values for these: tests/chaos/schemathesis_hooks.py)
JSON_SCHEMA_TEXT = "json-schema"  # a JSON schema as JSON text
REGEX = "regex"  # JSON Schema's own format name
GRAMMAR = "lark-or-gbnf"  # a Lark or llama.cpp GBNF grammar


# Rules across fields are written positively (anyOf of the cases that are accepted, no if/then and
# no `not`): a schema-driven generator can then enumerate the cases instead of giving up on them.


def _only_with(field: str, flag: str) -> dict[str, Any]:
    """`field` must be null or absent unless `flag` is true."""
    return {"anyOf": [{"required": [flag], "properties": {flag: {"const": True}}}, _null(field)]}


def _null(*names: str) -> dict[str, Any]:
    """Each of `names` absent or null."""
    return {"properties": {name: {"type": "null"} for name in names}}


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


def _options(prop: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The alternatives of a property (its anyOf, or itself) of JSON type `kind`."""
    return [o for o in prop.get("anyOf", [prop]) if o.get("type") == kind]


def _set(prop: dict[str, Any], kind: str, **keywords: Any) -> None:
    """Add `keywords` to each alternative of `prop` of JSON type `kind`."""
    for option in _options(prop, kind):
        option.update(keywords)


def _spec_text(prop: dict[str, Any], limits: RequestCaps, fmt: str) -> None:
    """A structured-output spec given as text: not blank, at most the size cap. `format` names what it
    must be (a schema-driven fuzzer can be given valid values for it: tests/chaos/schemathesis_hooks.py)."""
    _set(prop, "string", minLength=1, maxLength=limits.max_schema_chars, pattern=NOT_BLANK, format=fmt)


def _cap_lists(props: dict[str, Any], limits: RequestCaps) -> None:
    """The caps on the list fields both requests share."""
    if "stop" in props:
        _set(props["stop"], "array", maxItems=limits.max_stop)
    _set(props["stop_token_ids"], "array", maxItems=limits.max_stop_token_ids)
    _set(props["allowed_token_ids"], "array", maxItems=limits.max_allowed_token_ids)
    _set(
        props["logit_bias"],
        "object",
        maxProperties=limits.max_logit_bias,
        propertyNames={"pattern": f"^{LOGIT_BIAS_KEY.pattern}$"},
    )
    _set(props["bad_words"], "array", maxItems=limits.max_bad_words)
    for option in _options(props["bad_words"], "array"):
        option["items"].update(pattern=NOT_BLANK)  # a word of spaces is refused
    _spec_text(props["guided_json"], limits, JSON_SCHEMA_TEXT)
    _spec_text(props["guided_regex"], limits, REGEX)
    _spec_text(props["guided_grammar"], limits, GRAMMAR)
    _set(props["guided_choice"], "array", minItems=1)
    for option in _options(props["guided_choice"], "array"):
        option["items"].update(minLength=1)


def _cap_prompt(prop: dict[str, Any], limits: RequestCaps) -> None:
    """Prompts per request; tokens of a prompt given as token ids."""
    for option in _options(prop, "array"):
        if option["items"].get("type") == "integer":  # one prompt, as token ids
            if limits.max_prompt_tokens is not None:
                option["maxItems"] = limits.max_prompt_tokens
            continue
        option["maxItems"] = limits.max_prompts
        inner = option["items"]
        if inner.get("type") == "array" and limits.max_prompt_tokens is not None:
            inner["maxItems"] = limits.max_prompt_tokens


SPEC_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
PLAIN_FORMAT = {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}  # asks for none


def _no_spec_but(field: str | None) -> dict[str, Any]:
    """No structured-output field asks for anything, except `field` perhaps."""
    rule = _null(*(f for f in SPEC_FIELDS if f != field))
    if field != "response_format":
        rule["properties"]["response_format"] = PLAIN_FORMAT
    return rule


ONE_SPEC = {"anyOf": [_no_spec_but(field) for field in ("response_format", *SPEC_FIELDS)]}


def _tool_rule() -> dict[str, Any]:
    """Chat: tool_choice "required" or a named function needs tools, and then no structured-output field."""
    forced = _no_spec_but(None)
    forced["required"] = ["tools"]
    forced["properties"]["tools"] = {"type": "array", "minItems": 1}
    return {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", "auto", None]}}}, forced]}


def _chat_rules() -> list[dict[str, Any]]:
    """The chat request's rules across fields. schemathesis's canonicalizer (jsonschema_rs) multiplies
    an allOf of anyOfs out into one case per combination of their branches, each a copy of every
    property, and gives up (the operation is then not fuzzed at all) once its intersections, which
    grow as the square of cases x properties, pass a fixed budget. `stream_options` with `stream` (2
    cases) x one structured-output field (6) x the tool rule (which folds into the spec cases: 7) make
    14 cases, room for about 40 more properties; `top_logprobs` only with `logprobs` doubled them and
    left none, so it stays a 400 naming the field (compat/schemathesis.toml).
    tests/chaos/test_fields.py checks the room left."""
    return [_only_with("stream_options", "stream"), ONE_SPEC, _tool_rule()]


def _structured_rules(components: dict[str, Any]) -> None:
    """`structured_outputs` asks for exactly one thing; `response_format` of type json_schema has a schema."""
    kinds = {"json": ["object", "string"], "regex": ["string"], "choice": ["array"], "grammar": ["string"]}
    cases = []
    for kind, types in kinds.items():
        case = _null(*(k for k in kinds if k != kind))
        case["properties"][kind] = {"type": types}
        case["properties"]["json_object"] = {"enum": [False, None]}
        cases.append({"required": [kind], **case})
    cases.append({"required": ["json_object"], **_null(*kinds)})
    cases[-1]["properties"]["json_object"] = {"const": True}
    components["StructuredOutputsField"]["anyOf"] = cases
    schema = {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}
    components["ResponseFormat"]["anyOf"] = [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["json_schema"], "properties": {"json_schema": schema}},
    ]


def _cap_components(components: dict[str, Any], limits: RequestCaps) -> None:
    """The caps on the shared components: structured_outputs, response_format's schema, tools."""
    so = components["StructuredOutputsField"]["properties"]
    _spec_text(so["json"], limits, JSON_SCHEMA_TEXT)
    _spec_text(so["regex"], limits, REGEX)
    _spec_text(so["grammar"], limits, GRAMMAR)
    _set(so["choice"], "array", minItems=1)
    for option in _options(so["choice"], "array"):
        option["items"].update(minLength=1)
    chat = components["ChatCompletionRequest"]["properties"]
    _set(chat["tools"], "array", maxItems=limits.max_tools)


def constrain(
    components: dict[str, Any],
    model_name: str,
    max_model_len: int,
    limits: RequestCaps,
    vocab_size: int,
) -> None:
    """Tighten the request schemas in `components` (in place) to what this server accepts."""
    cap = min(max_model_len, limits.max_tokens) if limits.max_tokens is not None else max_model_len
    for name, rules in (
        ("CompletionRequest", [_only_with("stream_options", "stream"), ONE_SPEC]),
        ("ChatCompletionRequest", _chat_rules()),
    ):
        schema = components[name]
        props = schema["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}], "title": "Model"}
        _cap(props["n"], limits.max_n)
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if field in props:
                _cap(props[field], cap)
        for field in ("prompt", "stop_token_ids", "allowed_token_ids"):
            if field in props:
                _cap_token_ids(props[field], vocab_size)
        _cap_lists(props, limits)
        schema["allOf"] = rules
        schema["additionalProperties"] = not limits.strict_fields  # unknown fields are ignored unless strict
    _cap_prompt(components["CompletionRequest"]["properties"]["prompt"], limits)
    _cap_components(components, limits)
    _structured_rules(components)
    _cap_token_ids(components["DetokenizeRequest"]["properties"]["tokens"], vocab_size)
    tokenize = components["TokenizeRequest"]
    props = tokenize["properties"]
    array = next(o for o in props["messages"]["anyOf"] if o.get("type") == "array")
    tokenize["oneOf"] = [  # exactly one of the two is given (not null)
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": array}},
    ]
