"""A request body to JSON, refusing what would hurt the server: nesting deeper than a limit (checked on
the raw bytes, before `json.loads` recurses into it), lone UTF-16 surrogates in any string (valid JSON,
but not text: a tokenizer raises TypeError on them), and invalid JSON. Every refusal is a 400 naming
the limit or the field.

`parse_json` is plain CPU work: the app runs it off the event loop, with the rest of a request's
preparation.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from tokenmill.server.validation import RequestError, param_path

# A JSON string: a quote, then runs of plain characters and escapes, then a quote (the unrolled
# form: one character class repeated, so it scans a 20 MB string as fast as re can).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# What a lone surrogate can come from in the raw body: a \uD800-\uDFFF escape, or its 3 UTF-8 bytes
# (json decodes bytes with surrogatepass). A surrogate pair matches too; the parsed text tells.
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CHUNK = 1 << 20  # bytes per step of the depth scan: bounds its arrays ([1 MiB] int32)
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def nesting_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body`, brackets inside strings not counted.
    Linear in the body, in C (a regex and numpy); an unterminated string counts its brackets, which
    can only over-count a body that is not valid JSON anyway."""
    stripped = _STRING.sub(b'""', body)
    deepest = depth = 0
    for start in range(0, len(stripped), _CHUNK):
        chunk = np.frombuffer(stripped, dtype=np.uint8, count=min(_CHUNK, len(stripped) - start), offset=start)
        step = np.isin(chunk, _OPEN).astype(np.int32) - np.isin(chunk, _CLOSE).astype(np.int32)  # [chunk]
        running = depth + np.cumsum(step)  # [chunk]
        if len(running):
            deepest = max(deepest, int(running.max()))
            depth = int(running[-1])
    return deepest


def check_depth(body: bytes, limit: int) -> None:
    """400 when `body` nests arrays and objects deeper than `limit`."""
    if body.count(b"[") + body.count(b"{") <= limit:  # cannot be deeper: the common case, in C
        return
    depth = nesting_depth(body)
    if depth > limit:
        raise RequestError(
            f"The body nests arrays and objects {depth} deep; at most {limit} are allowed (--max-json-depth).",
            None,
            "nesting_too_deep",
        )


def lone_surrogate_path(value: Any) -> tuple[str | int, ...] | None:
    """Where the first string holding a lone surrogate is in a parsed JSON value (an object key's
    own path for a key), or None. Iterative: the value may nest as deep as the limit allows."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    return (*path, key.encode("utf-8", "backslashreplace").decode())
                stack.append(((*path, key), child))
        elif isinstance(item, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(item))))
    return None


def check_text(value: Any, body: bytes) -> None:
    """400 naming the field when a string in `value` (parsed from `body`) holds a lone surrogate."""
    if not _SURROGATE_SOURCE.search(body):  # none can be there: the common case, in C
        return
    try:  # only surrogate pairs (an emoji, say): the value encodes, in C
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    path = lone_surrogate_path(value)
    if path is not None:
        param = param_path(path) or None
        where = f"'{param}'" if param else "the body"
        raise RequestError(
            f"Invalid value for {where}: it holds a lone UTF-16 surrogate (such as \\ud800), which is not text.",
            param,
            "invalid_value",
        )


def parse_json(body: bytes, max_depth: int) -> Any:
    """`body` as JSON, checked: depth, then the parse, then lone surrogates (see the module docstring)."""
    check_depth(body, max_depth)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"The body is not valid JSON ({e}).", None, "invalid_json") from None
    except RecursionError:  # (the depth check stops this first; kept as the last line of defence)
        raise RequestError("The body nests arrays and objects too deep.", None, "nesting_too_deep") from None
    except ValueError as e:  # (Python's cap on an integer's digits: a number of thousands of digits)
        raise RequestError(f"The body holds a number JSON cannot be read as ({e}).", None, "invalid_json") from None
    check_text(value, body)
    return value
