"""The caps on what one request may ask for (`RequestCaps`), checked at the front door.

Owns the checks that bound a request's cost before the engine sees it: the count of a list field
(`bad_words`, `logit_bias`, `stop_token_ids`, prompts, n x prompts, tools, ...), the size of a
structured-output spec or a tool's parameters (characters of its JSON text), and the nesting depth of
a JSON schema. Depth is measured iteratively on the raw body, before anything that recurses
(`json.dumps`, the chat template's `tojson`, the grammar compiler) touches the value, so a schema
nested 5,000 deep is a 400 naming its field, never a RecursionError. Each refusal is a 400
`RequestError` naming the field and the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from tokenmill.server.validation import RequestCaps, RequestError

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")
PARSE_DEPTH = 128  # JSON parsed from text (tool-call arguments) nests at most this deep; deeper stays text


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests (a scalar 0, `{}` 1, `{"a": []}` 2), counted without recursion;
    counting stops at `limit + 1` (enough to know it is too deep)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def text_depth(text: str) -> int:
    """How deeply JSON text nests (brackets outside strings), without parsing it."""
    brackets = _BRACKETS.findall(_JSON_STRING.sub("", text))
    return max(accumulate(1 if b in "[{" else -1 for b in brackets), default=0)


def parse_json(text: str, max_depth: int = PARSE_DEPTH) -> Any:
    """`json.loads`, except that text nested deeper than `max_depth` is a ValueError (as invalid JSON
    is) instead of a RecursionError: for JSON a client or the model wrote (tool-call arguments)."""
    if text_depth(text) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text)


def too_many(param: str, count: int, limit: int, what: str) -> RequestError:
    return RequestError(
        f"Invalid value for '{param}': {count} {what}, this server allows at most {limit}.", param, "invalid_value"
    )


def check_count(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise too_many(param, count, limit, what)


def json_chars(value: Any) -> int:
    """Characters of a value's compact JSON text (a string: its length). Call on a value whose depth
    is known to be bounded."""
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _schemas(raw: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The JSON schemas of a raw body: (the field's path, the value)."""
    yield "guided_json", raw.get("guided_json")
    so = raw.get("structured_outputs")
    if isinstance(so, dict):
        yield "structured_outputs.json", so.get("json")
    fmt = raw.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        yield "response_format.json_schema.schema", fmt["json_schema"].get("schema")
    tools = raw.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict):
                yield f"tools[{i}].function.parameters", function.get("parameters")


def _specs(raw: dict[str, Any]) -> Iterator[tuple[str, Any, bool]]:
    """Every structured-output spec and tool schema of a raw body: (path, value, whether JSON)."""
    for param, value in _schemas(raw):
        yield param, value, True
    for name in ("guided_regex", "guided_grammar", "guided_choice"):
        yield name, raw.get(name), False
    so = raw.get("structured_outputs")
    if isinstance(so, dict):
        for key in ("regex", "grammar", "choice"):
            yield f"structured_outputs.{key}", so.get(key), False


def check_specs(raw: dict[str, Any], limits: RequestCaps) -> None:
    """Depth and size of a raw body's schemas and structured-output specs (values of the wrong type
    are left to the schema's 400). Run before validation: nothing has recursed into them yet."""
    depth_limit, size_limit = limits.max_schema_depth, limits.max_schema_chars
    for param, value, is_json in _specs(raw):
        if isinstance(value, str):
            check_count(param, len(value), size_limit, "characters")
            depth = text_depth(value) if is_json else 0
        elif isinstance(value, dict | list):
            depth = json_depth(value, depth_limit)
        else:
            continue
        if depth > depth_limit:
            raise RequestError(
                f"Invalid value for '{param}': nested deeper than this server allows ({depth_limit} levels).",
                param,
                "invalid_value",
            )
        check_count(param, json_chars(value), size_limit, "characters of JSON")
