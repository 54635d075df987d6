"""Request validation support: the error a refused request becomes, the server's limits, the policy
for OpenAI fields tokenmill does not support yet, and turning pydantic's errors into OpenAI's shape.

Every refusal is a `RequestError`: an HTTP status and OpenAI's error body naming the parameter
(`messages[0].content`, `stop[1]`, ...) so that a client sees which field is wrong.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from tokenmill.errors import ContextTooLong, EmptyPrompt, ParamError, TokenOutsideVocabulary

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


def refusal(e: ParamError, prompt_param: str, max_tokens_param: str, structured_field: str | None) -> RequestError:
    """The 400 of a request the engine's front door refused (`engine.request_checks`), in the server's
    words: mapped by the error's type and field, never its text. `prompt_param` names the prompt as
    the request gave it ("prompt", "prompt[i]", "messages"), `max_tokens_param` the field that set
    max_tokens, `structured_field` the one that asked for structured output."""
    if isinstance(e, ContextTooLong):
        if e.max_tokens is not None and e.max_tokens > e.max_model_len:
            return RequestError(
                f"Invalid value for '{max_tokens_param}': {e.max_tokens} is more than the model's maximum "
                f"length ({e.max_model_len} tokens).",
                max_tokens_param,
                "invalid_value",
            )
        generated = e.max_tokens or 1
        wanted = e.num_prompt_tokens + generated
        return RequestError(
            f"This model's maximum context length is {e.max_model_len} tokens. However, you requested {wanted} "
            f"tokens ({e.num_prompt_tokens} in the {prompt_param}, {generated} in the completion). Please reduce "
            "the length of the prompt or the completion.",
            prompt_param,
            "context_length_exceeded",
        )
    if isinstance(e, TokenOutsideVocabulary):
        return RequestError(
            f"Invalid value for '{prompt_param}': token id {e.token_id} is outside the vocabulary ({e.vocab_size}).",
            prompt_param,
            "invalid_value",
        )
    if isinstance(e, EmptyPrompt):
        return RequestError(f"Invalid value for '{prompt_param}': the prompt is empty.", prompt_param, "invalid_value")
    if e.param.startswith("structured_outputs"):  # the spec did not compile
        return RequestError(f"Invalid value for '{structured_field}': {e}", structured_field, "invalid_value")
    return RequestError(str(e), e.param, "invalid_value")


@dataclass(frozen=True)
class RequestCaps:
    """Server-side caps on what one request may ask for (beyond what the schema allows). The defaults
    sit well above what OpenAI or vLLM clients send (OpenAI itself allows 4 stop strings, 300
    logit_bias entries and 128 tools) and bound what one request can cost everyone else; each
    refusal is a 400 naming the field and the limit, and `/openapi.json` states the same caps. The
    operator's policy, not the engine's size: what the engine can hold at all (its model length, KV
    blocks, vocabulary) is `EngineLimits`, checked at the engine's front door."""

    max_n: int = 16
    max_tokens: int | None = None  # cap on max_tokens / max_completion_tokens; None: no extra cap
    max_prompt_tokens: int | None = None  # None: only the model's length limits the prompt
    max_stop: int = 16  # OpenAI allows 4
    max_prompts: int = 64  # prompts in one completions request (each an engine request)
    max_pooling_inputs: int = 2048  # embeddings inputs, rerank documents, score texts per side (OpenAI: 2048)
    max_choices: int = 128  # n x prompts: the sequences one request starts
    max_stop_token_ids: int = 1024
    max_allowed_token_ids: int = 16384
    max_logit_bias: int = 1024  # OpenAI allows 300
    max_bad_words: int = 1024
    max_bad_words_chars: int = 32768  # all bad words together
    max_tools: int = 128  # as OpenAI
    max_tools_chars: int = 262144  # all tools' definitions together, as JSON text
    # each guided_json / guided_regex / guided_grammar / guided_choice, structured_outputs field,
    # response_format schema and tool's parameters: characters of its JSON text (a string: its length)
    max_schema_chars: int = 131072
    max_schema_depth: int = 64  # nesting of a JSON schema (guided_json, response_format, tool parameters)
    strict_fields: bool = False  # refuse (400) unknown fields instead of ignoring them


def split_unknown(raw: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(the body without the fields not in `known`, their names in order): an unknown field is
    ignored, as vLLM does, unless the server is strict about fields."""
    unknown = [k for k in raw if k not in known]
    return ({k: v for k, v in raw.items() if k in known} if unknown else raw), unknown


MAX_WARNED_FIELDS = 256  # distinct unknown field names a server remembers having logged
MAX_LOGGED_NAME = 64  # characters of a name in the log
MAX_LOGGED_NAMES = 10  # names listed in one log line (then "and N more")


def ignored_fields_warning(names: list[str], warned: set[str]) -> str | None:
    """The log line for those of a request's unknown field names not logged before (None if none).
    `warned` (updated in place) remembers at most MAX_WARNED_FIELDS names, each cut to MAX_LOGGED_NAME
    characters; once it is full nothing more is logged (the line that fills it says so), so that
    clients sending ever new names grow neither the memory nor the log."""
    if len(warned) >= MAX_WARNED_FIELDS:
        return None
    new: dict[str, None] = {}  # (ordered, distinct)
    for name in names:
        short = name if len(name) <= MAX_LOGGED_NAME else name[: MAX_LOGGED_NAME - 3] + "..."
        if short not in warned:
            new[short] = None
    if not new:
        return None
    fresh = list(new)
    warned.update(fresh[: MAX_WARNED_FIELDS - len(warned)])
    listed = ", ".join(ascii(n) for n in fresh[:MAX_LOGGED_NAMES])
    if len(fresh) > MAX_LOGGED_NAMES:
        listed += f" and {len(fresh) - MAX_LOGGED_NAMES} more"
    line = f"ignored unknown request fields {listed} (send --strict-fields to refuse them)"
    if len(warned) >= MAX_WARNED_FIELDS:
        line += f"; {MAX_WARNED_FIELDS} distinct names logged, later ones are not"
    return line


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


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 60
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 8


def show(value: Any) -> str:
    """A short repr of a client's value for a message: bounded in depth and items (a deep or huge
    value costs no more than a small one), at most 60 characters."""
    text = _SHOW.repr(value)
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
    refuses other floats, numeric strings and booleans). Inside a list and a list of lists (token
    ids, prompts of token ids); deeper values are left as they are (for the schema to refuse)."""
    if isinstance(value, list):
        return [[_integral(v) for v in item] if isinstance(item, list) else _integral(item) for item in value]
    return _integral(value)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


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
            n = integral(raw.get("n"))
            n = 1 if n is None else n
            value = integral(value)
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


# what `unsupported_default` accepts besides null, in JSON Schema (for /openapi.json)
UNSUPPORTED_ACCEPTED: dict[str, list[dict[str, Any]]] = {
    "metadata": [{"type": "object", "maxProperties": 0}],
    "suffix": [{"const": ""}],
    "best_of": [{"type": "integer", "minimum": 1, "description": "equal to n"}],
    "modalities": [{"const": ["text"]}],
    "store": [{"const": False}],
    "service_tier": [{"enum": ["auto", "default"]}],
    "tool_calls": [{"type": "array", "maxItems": 0}],
    "annotations": [{"type": "array", "maxItems": 0}],
}


def unsupported_schema(name: str) -> dict[str, Any]:
    """The JSON schema of unsupported field `name`: only its default (see `unsupported_default`)."""
    return {
        "anyOf": [{"type": "null"}, *UNSUPPORTED_ACCEPTED.get(name, [])],
        "description": "Not supported by tokenmill yet: only its default is accepted.",
    }


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
