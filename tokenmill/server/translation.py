"""What the other APIs share when they are served on the chat path: a request of Anthropic's Messages
API (server/anthropic.py) or OpenAI's Responses API (server/responses_api.py) is translated into a
`ChatCompletionRequest` (so every sampling, cap, structured-output and tool feature carries over),
run as one, and its chat answer (the JSON, or the stream's chat chunks) translated back.

Owns `Translated` (the chat request and the two ways back), the renaming of a chat refusal's field
into the API's own name for it, and the reading of a chat stream's server-sent events.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from tokenmill.server.chat_protocol import ChatCompletionRequest, parse_chat_request
from tokenmill.server.validation import (
    PARAM,
    RequestCaps,
    RequestError,
    custom_error,
    from_validation_error,
    split_unknown,
)

ModelT = TypeVar("ModelT", bound=BaseModel)
Renames = Sequence[tuple[str, str]]  # (a regular expression on a chat field's path, the API's path)

# answer(chat response JSON, chat request id) -> the API's JSON
Answer = Callable[[dict[str, Any], str], dict[str, Any]]
# events(chat chunks, chat request id, prompt tokens) -> the API's server-sent events
Events = Callable[[AsyncIterator[dict[str, Any]], str, int], AsyncIterator[str]]


@dataclass
class Translated:
    """A request of another API as a chat request, and how its answer is written back."""

    chat: ChatCompletionRequest
    answer: Answer
    events: Events
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields of the original body
    renames: Renames = ()  # a refusal's chat field -> the API's name for it

    @property
    def stream(self) -> bool:
        return self.chat.stream

    def in_its_words(self, e: RequestError) -> RequestError:
        """A refusal of the chat path (the engine's front door, say) naming the API's field."""
        return renamed(e, self.renames)


def parse_body(cls: type[ModelT], raw: Any, limits: RequestCaps) -> tuple[ModelT, list[str]]:
    """A raw JSON body -> (a valid `cls`, the unknown fields dropped from it), or a RequestError (400)
    naming the field. Unknown fields are ignored (vLLM's policy), or refused with `limits.strict_fields`."""
    if not isinstance(raw, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_body")
    ignored: list[str] = []
    if not limits.strict_fields:
        raw, ignored = split_unknown(raw, set(cls.model_fields))
    try:
        return cls.model_validate(raw), ignored
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def validate_part(model: type[ModelT], raw: Any, loc: tuple[str | int, ...]) -> ModelT:
    """One part of a request (a block, an item) validated as `model`, its refusal naming it from the
    top of the request (`messages[0].content[2].name`): a field validator that picks each part's model
    by its type gets pydantic's location right this way."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        error = from_validation_error(e)
        raise _nested(error, loc) from None


def _nested(error: RequestError, loc: tuple[str | int, ...]) -> PydanticCustomError:
    inner = _loc(error.param)
    message = error.message.replace(f"'{error.param}'", f"'{PARAM}'") if error.param else error.message
    return custom_error(message, (*loc, *inner), error.code or "invalid_value", whole=True)


def _loc(param: str | None) -> tuple[str | int, ...]:
    """'content[0].text' -> ('content', 0, 'text') (the inverse of validation.param_path)."""
    out: list[str | int] = []
    for part in (param or "").replace("[", ".").replace("]", "").split("."):
        if part:
            out.append(int(part) if part.isdigit() else part)
    return tuple(out)


def parse_as_chat(body: dict[str, Any], limits: RequestCaps, renames: Renames) -> ChatCompletionRequest:
    """The chat request `body` describes (built from an already valid request of another API); a
    refusal that only the chat path can make (a cap, say) names the field as the other API calls it."""
    try:
        return parse_chat_request(body, limits)
    except RequestError as e:
        raise renamed(e, renames) from None


def renamed(e: RequestError, renames: Renames) -> RequestError:
    """`e` with its parameter (and the parameter's name in its message) as the other API names it."""
    if e.param is None:
        return e
    for pattern, replacement in renames:
        param, found = re.subn(pattern, replacement, e.param, count=1)
        if found:
            message = e.message.replace(f"'{e.param}'", f"'{param}'")
            return RequestError(message, param, e.code, e.status, e.type)
    return e


async def chat_chunks(sse: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a chat stream's events (`data: {...}`), without the closing `[DONE]`. An
    error event comes through as `{"error": {...}}`."""
    async for event in sse:
        data = event.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            yield json.loads(data)


def sse(event: str, payload: dict[str, Any]) -> str:
    """One named server-sent event (Anthropic's and the Responses API's streams name each event)."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
