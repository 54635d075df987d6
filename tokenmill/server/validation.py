"""Request validation support: the error a refused request becomes, the server's limits, the policy
for OpenAI fields tokenmill does not support yet, and turning pydantic's errors into OpenAI's shape.

Every refusal is a `RequestError`: an HTTP status and OpenAI's error body naming the parameter
(`messages[0].content`, `stop[1]`, ...) so that a client sees which field is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from tokenmill.errors import ParamError

INVALID_REQUEST = "invalid_request_error"
PARAM = "{param}"  # in a custom error's message: replaced by the parameter's full path


class RequestError(Exception):
    """A request the server refuses; `body()` is OpenAI's error JSON, `status` its HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = INVALID_REQUEST,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def param_of(exc: ValueError) -> str | None:
    """The request field a refusal names: a `ParamError` carries it; another ValueError names none."""
    return exc.param if isinstance(exc, ParamError) else None


@dataclass(frozen=True)
class Limits:
    """Server-side caps on what one request may ask for (beyond what the schema allows)."""

    max_n: int = 16
    max_tokens: int | None = None  # cap on max_tokens / max_completion_tokens; None: no extra cap
    max_prompt_tokens: int | None = None  # None: only the model's length limits the prompt
    max_stop: int = 16  # OpenAI allows 4
    strict_fields: bool = False  # refuse (400) unknown fields instead of ignoring them


def split_unknown(raw: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(the body without the fields not in `known`, their names in order): an unknown field is
    ignored, as vLLM does, unless the server is strict about fields."""
    unknown = [k for k in raw if k not in known]
    return ({k: v for k, v in raw.items() if k in known} if unknown else raw), unknown


def custom_error(
    detail: str, loc: tuple[str | int, ...] = (), code: str = "invalid_value", whole: bool = False
) -> PydanticCustomError:
    """A validation error with our own message; `loc` extends the location pydantic reports. The
    message becomes "Invalid value for '<param>': <detail>"; or, when `whole`, `detail` itself with
    PARAM replaced by the parameter's full path (known only once the error reaches the top)."""
    return PydanticCustomError("tokenmill", "{message}", {"message": detail, "loc": loc, "code": code, "whole": whole})


def param_path(loc: Sequence[str | int]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


TYPE_MESSAGES = {
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected a boolean",
    "list_type": "expected an array",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
}


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def from_validation_error(exc: ValidationError) -> RequestError:
    """The first error of a pydantic validation, as a 400 naming the parameter."""
    error = exc.errors(include_url=False)[0]
    ctx = error.get("ctx") or {}
    loc = tuple(error["loc"]) + tuple(ctx.get("loc", ()))
    param = param_path(loc) or None
    kind = error["type"]
    if kind == "tokenmill":
        if ctx["whole"]:
            return RequestError(ctx["message"].replace(PARAM, param or ""), param, ctx["code"])
        what = "type" if ctx["code"] == "invalid_type" else "value"
        return RequestError(f"Invalid {what} for '{param}': {ctx['message']}", param, ctx["code"])
    if kind == "extra_forbidden":
        return RequestError(f"Unknown field '{param}'.", param, "unknown_field")
    if kind == "missing":
        return RequestError(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind == "too_short":
        detail = f"expected at least {ctx['min_length']} item(s), got {show(error['input'])}."
        return RequestError(f"Invalid value for '{param}': {detail}", param, "invalid_value")
    if kind in TYPE_MESSAGES:
        expected = TYPE_MESSAGES[kind]
        return RequestError(
            f"Invalid type for '{param}': {expected}, got {show(error['input'])}.", param, "invalid_type"
        )
    return RequestError(
        f"Invalid value for '{param}': {error['msg']}, got {show(error['input'])}.", param, "invalid_value"
    )


def integral(value: Any) -> Any:
    """JSON Schema's integers include 1.0: an integral float is read as that int (strict parsing still
    refuses other floats, numeric strings and booleans)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def unsupported_default(name: str, value: Any, raw: dict[str, Any]) -> str | None:
    """None when `value` is the default of unsupported field `name` (so it may be dropped), else what
    would be accepted, for the error message."""
    if value is None:
        return None
    match name:
        case "response_format":
            ok, allowed = value == {"type": "text"}, 'null or {"type": "text"}'
        case "metadata":
            ok, allowed = isinstance(value, dict) and not value, "null or {}"
        case "suffix":
            ok, allowed = value == "", 'null or ""'
        case "best_of":
            n = raw.get("n")
            n = 1 if n is None else n
            ok, allowed = is_int(value) and is_int(n) and value == n, "null or equal to n"
        case "modalities":
            ok, allowed = value == ["text"], 'null or ["text"]'
        case "store":
            ok, allowed = value is False, "null or false"
        case "service_tier":
            ok, allowed = value in ("auto", "default"), 'null, "auto" or "default"'
        case "tool_calls" | "annotations":
            ok, allowed = value == [], "null or []"
        case _:
            ok, allowed = False, "null"
    return None if ok else allowed


def check_unsupported(raw: Any, fields: tuple[str, ...]) -> Any:
    """Drop unsupported fields that hold their default; raise for any other value."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for name in fields:
        if name not in out:
            continue
        allowed = unsupported_default(name, out[name], raw)
        if allowed is not None:
            raise custom_error(
                f"'{PARAM}' is not supported by tokenmill yet (got {show(out[name])}); leave it out or send {allowed}.",
                (name,),
                "unsupported_field",
                whole=True,
            )
        del out[name]
    return out
