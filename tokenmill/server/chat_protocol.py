"""The chat request schema: POST /v1/chat/completions, its messages and their text content parts.

Built on the request base of `protocol.py` (strict parsing, the unsupported-field and unknown-field
policies, the shared sampling fields); `parse_chat_request` turns a raw JSON value into a valid
request or a `RequestError` (400 naming the parameter).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.caps import check_count, parse_json
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
from tokenmill.server.tools import NamedToolChoice, ToolCall, ToolChoice, ToolMode, ToolParam, tool_mode
from tokenmill.server.validation import RequestCaps, check_unsupported, custom_error, show, unsupported_schema


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


def _message_schema(schema: dict[str, Any]) -> None:
    """The rules of `ChatMessageParam._roles` in JSON Schema, one case per role (written positively, so
    that a schema-driven generator can enumerate them), so that `/openapi.json` promises no message the
    server refuses: content left out only beside an assistant's tool calls, null also for a tool's
    answer; `tool_call_id` (non-empty) on tool messages only; `tool_calls` on assistant ones."""
    text = {"type": ["string", "array"]}
    no_calls = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    schema["required"] = ["role"]
    schema["anyOf"] = [
        {
            "required": ["content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user"]},
                "content": text,
                "tool_call_id": {"type": "null"},
                "tool_calls": no_calls,
            },
        },
        {
            "required": ["content"],
            "properties": {"role": {"const": "assistant"}, "content": text, "tool_call_id": {"type": "null"}},
        },
        {
            "required": ["tool_calls"],
            "properties": {
                "role": {"const": "assistant"},
                "tool_calls": {"type": "array", "minItems": 1},
                "tool_call_id": {"type": "null"},
            },
        },
        {
            "required": ["content", "tool_call_id"],
            "properties": {
                "role": {"const": "tool"},
                "tool_call_id": {"type": "string", "minLength": 1},
                "tool_calls": no_calls,
            },
        },
    ]
    for name in ChatMessageParam.UNSUPPORTED:  # accepted with their default only
        schema["properties"][name] = unsupported_schema(name)


class ChatMessageParam(_Strict):
    """One message of a chat request. Content is a string or a list of text parts (joined by `text`)."""

    model_config = ConfigDict(json_schema_extra=_message_schema)

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "function_call",
        "refusal",
        "audio",
        "annotations",
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: an empty tool answer (as OpenAI and vLLM read it), or an assistant's tool calls (then it may be left out)
    content: str | list[TextContentPart] | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _roles(self) -> ChatMessageParam:
        if self.content is None and not (self.role == "tool" or (self.role == "assistant" and self.tool_calls)):
            raise custom_error("'content' is required (null only for a tool message or an assistant's tool_calls).")
        if self.role == "tool" and not self.tool_call_id:
            raise custom_error("a 'tool' message needs the 'tool_call_id' it answers.")
        if self.role != "tool" and self.tool_call_id is not None:
            raise custom_error("'tool_call_id' belongs to a 'tool' message.")
        if self.role != "assistant" and self.tool_calls:
            raise custom_error("'tool_calls' belong to an 'assistant' message.")
        return self

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, raw: Any) -> Any:
        raw = check_unsupported(raw, cls.UNSUPPORTED)
        if isinstance(raw, dict) and raw.get("tool_calls") and "content" not in raw:
            raw = {**raw, "content": None}  # an assistant's calls need no content
        return raw

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
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
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return CONTENT_PART_SEPARATOR.join(part.text for part in self.content)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = tuple(n for n in _Request.UNSUPPORTED if n != "reasoning_effort")

    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: PositiveInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PositiveInt | None = None  # None: the server's default (up to the model's length)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[ToolParam], Field(min_length=1)] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None
    # reasoning (server/reasoning.py): more variables for the chat template (vLLM's), the effort asked of a
    # template that reads `reasoning_effort`, and whether a reasoning parser's reasoning_content is sent
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="More variables for the chat template (enable_thinking, say): names a template can read, "
        "not the parameters of transformers' apply_chat_template.",
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None, description="Given to a chat template that reads reasoning_effort."
    )
    include_reasoning: bool = Field(
        default=True, description="Whether reasoning_content is sent (with tokenmill serve --reasoning-parser)."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        self._stream_options_check()
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise custom_error(
                f"tool_choice {show(named or self.tool_choice)} needs 'tools'.", ("tool_choice",), whole=True
            )
        if named is not None and named not in {t.function.name for t in self.tools or ()}:
            raise custom_error(f"no tool named {show(named)} in 'tools'.", ("tool_choice",), whole=True)
        if self.tool_mode is not None and self.tool_mode.choice != "auto" and self.structured_field is not None:
            raise custom_error(
                f"tool_choice {show(named or self.tool_choice)} and '{self.structured_field}' both constrain "
                "the answer; send one.",
                ("tool_choice",),
                whole=True,
            )
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

    @property
    def tool_mode(self) -> ToolMode | None:
        return tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)

    def template_variables(self) -> dict[str, Any]:
        """What the chat template gets besides the messages and tools: `reasoning_effort` if sent, then
        `chat_template_kwargs` (which may set it too)."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return {**effort, **(self.chat_template_kwargs or {})}

    def to_sampling_params(self, max_model_len: int, default_max_tokens: int | None) -> SamplingParams:
        fields = self._common_sampling()
        spec = self.tool_mode.spec() if self.tool_mode is not None else None
        if spec is not None:  # "required" or a named function: under its schema
            fields["structured_outputs"] = spec
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            fields,
            self.requested_max_tokens,
            self.max_tokens_param,
            max_model_len,
            default_max_tokens,
            {"logprobs": "top_logprobs"},
        )


def conversation(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: role, content as text, name, an assistant's tool calls
    (arguments as objects, as templates expect) and a tool answer's call id. The "developer" role
    (OpenAI's newer name for "system") is given as "system", which templates know."""
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [
                {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _args(call: ToolCall) -> Any:
    """An earlier call's arguments as an object; as the text it is when that is not JSON, or nests
    too deep to parse (caps.parse_json)."""
    try:
        return parse_json(call.function.arguments)
    except ValueError:
        return call.function.arguments


def parse_chat_request(raw: Any, limits: RequestCaps) -> ChatCompletionRequest:
    """The parsed JSON body of POST /v1/chat/completions -> a valid request, or a RequestError (400)."""
    request = _parse(ChatCompletionRequest, raw, limits)
    _common_limits(request, limits)
    if request.tools:
        check_count("tools", len(request.tools), limits.max_tools, "tools")
        chars = sum(len(t.model_dump_json(exclude_none=True)) for t in request.tools)
        check_count("tools", chars, limits.max_tools_chars, "characters of JSON in all")
    _max_tokens_limit(request.requested_max_tokens, request.max_tokens_param, limits)
    return request
