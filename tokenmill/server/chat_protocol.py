"""The chat request schema: POST /v1/chat/completions, its messages and their text content parts.

Built on the request base of `protocol.py` (strict parsing, the unsupported-field and unknown-field
policies, the shared sampling fields); `parse_chat_request` turns a raw JSON value into a valid
request or a `RequestError` (400 naming the parameter).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import (
    CONTENT_PART_SEPARATOR,
    Logprobs,
    PositiveInt,
    _common_limits,
    _max_tokens_limit,
    _parse,
    _Request,
    _Strict,
)
from tokenmill.server.validation import Limits, check_unsupported, custom_error, show


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageParam(_Strict):
    """One message of a chat request. Content is a string or a list of text parts (joined by `text`)."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "tool_calls",
        "tool_call_id",
        "function_call",
        "refusal",
        "audio",
        "annotations",
    )

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, raw: Any) -> Any:
        return check_unsupported(raw, cls.UNSUPPORTED)

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise custom_error(f"expected a string or an array of text parts, got {show(value)}.", code="invalid_type")
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise custom_error(
                    f"only text content parts are supported, part {j} has type {show(kind)}.",
                    code="unsupported_content",
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise custom_error(f'part {j}: expected {{"type": "text", "text": "..."}}, got {show(part)}.')
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return CONTENT_PART_SEPARATOR.join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: PositiveInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PositiveInt | None = None  # None: the server's default (up to the model's length)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        self._stream_options_check()
        if self.top_logprobs is not None and not self.logprobs:
            raise custom_error("'top_logprobs' is only allowed when 'logprobs' is true.", ("top_logprobs",), whole=True)
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise custom_error(
                f"'max_tokens' ({self.max_tokens}) and 'max_completion_tokens' ({self.max_completion_tokens}) "
                "disagree; send only 'max_completion_tokens'.",
                ("max_tokens",),
                whole=True,
            )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)

    def to_sampling_params(self, max_model_len: int, default_max_tokens: int | None) -> SamplingParams:
        fields = self._common_sampling()
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            fields,
            self.requested_max_tokens,
            self.max_tokens_param,
            max_model_len,
            default_max_tokens,
            {"logprobs": "top_logprobs"},
        )


def conversation(messages: list[ChatMessageParam]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: role, content as text, and name when given. The
    "developer" role (OpenAI's newer name for "system") is given as "system", which templates know."""
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message.text}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def parse_chat_request(raw: Any, limits: Limits) -> ChatCompletionRequest:
    """The parsed JSON body of POST /v1/chat/completions -> a valid request, or a RequestError (400)."""
    request = _parse(ChatCompletionRequest, raw, limits)
    _common_limits(request, limits)
    _max_tokens_limit(request.requested_max_tokens, request.max_tokens_param, limits)
    return request
