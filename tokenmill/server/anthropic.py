"""Anthropic's Messages API, `POST /v1/messages`: the request schema and its translation onto the chat path.

What a request may hold: `system` (a string or text blocks), `messages` of role user / assistant whose
content is a string or blocks (`text`; an assistant's `tool_use` and `thinking`; a user's `tool_result`),
`max_tokens` (required), `stop_sequences`, `temperature` (0 to 1, as Anthropic), `top_p`, `top_k`,
`tools` (`name`, `description`, `input_schema`), `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), `thinking` (enabled, adaptive, between_tools / disabled: the chat template's
`enable_thinking`; `display: omitted` leaves thinking blocks out), `output_config` (`format` json_schema:
structured output; `effort`: the template's `reasoning_effort`), `stream`, `metadata`, `cache_control`.
`max_tokens: 0` (Anthropic's prompt-cache warming) is refused: tokenmill's prefix cache needs no
warming. Strict as the chat request is (a 400 naming the field, in Anthropic's error shape:
anthropic_answer.py); fields it does not know are ignored and listed, or refused with --strict-fields.

The translation: system -> a system message; a user's tool results -> tool messages (before the
user's text); an assistant's tool_use blocks -> its tool_calls (input as JSON arguments); thinking
blocks sent back are dropped (templates drop earlier reasoning too); tools -> functions with
`input_schema` as parameters; tool_choice any -> "required", tool -> a named function. The answer
and the stream are written back by anthropic_answer.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tokenmill.server.anthropic_answer import message_answer, message_events
from tokenmill.server.protocol import NonEmptyStr, PositiveInt, TopP, _Strict
from tokenmill.server.translation import Translated, parse_as_chat, parse_body, validate_part
from tokenmill.server.validation import PARAM, RequestCaps, custom_error, show

Temperature01 = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
RENAMES = (  # a chat field's path -> this API's
    (r"^stop\b", "stop_sequences"),
    (r"^max_completion_tokens\b", "max_tokens"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
    (r"^parallel_tool_calls\b", "tool_choice.disable_parallel_tool_use"),
    (r"^chat_template_kwargs\b", "thinking"),
    (r"^response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"^response_format\b", "output_config.format"),
    (r"^reasoning_effort\b", "output_config.effort"),
)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # (accepted, no effect: the prefix cache is automatic)
    citations: list[Any] | None = None


def _block_schema(schema: dict[str, Any]) -> None:
    """The fields each block type needs, in JSON Schema (as `ContentBlock._fields` checks them)."""
    needs = {
        "text": ["text"],
        "tool_use": ["id", "name", "input"],
        "tool_result": ["tool_use_id"],
        "thinking": ["thinking"],
        "redacted_thinking": ["data"],
    }
    schema["anyOf"] = [{"required": ["type", *f], "properties": {"type": {"const": t}}} for t, f in needs.items()]


class ContentBlock(_Strict):
    """One block of a message's content; which fields it needs depends on its type."""

    model_config = ConfigDict(json_schema_extra=_block_schema)

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: NonEmptyStr | None = None  # tool_use
    name: ToolName | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: NonEmptyStr | None = None  # tool_result
    content: str | list[TextBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None
    caller: dict[str, Any] | None = None  # (tool_use: accepted, not used)
    toolset_name: str | None = None  # (accepted, not used)

    @model_validator(mode="after")
    def _fields(self) -> ContentBlock:
        needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        needs |= {"thinking": ("thinking",), "redacted_thinking": ("data",)}
        for name in needs[self.type]:
            if getattr(self, name) is None:
                raise custom_error(
                    f"'{PARAM}' is required in a {self.type} block.", (name,), "missing_required_parameter", True
                )
        return self

    @property
    def result_text(self) -> str:
        """A tool_result's content as text."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> Any:
        """Each block validated alone, so that a refusal names it (`content[2].name`)."""
        if not isinstance(value, list):
            return value
        return [validate_part(ContentBlock, raw, (j,)) for j, raw in enumerate(value)]

    @model_validator(mode="after")
    def _roles(self) -> AnthropicMessage:
        for j, block in enumerate(self.content if isinstance(self.content, list) else []):
            if block.type not in ROLE_BLOCKS[self.role]:
                raise custom_error(
                    f"a '{block.type}' block does not belong in a '{self.role}' message.", ("content", j)
                )
        return self


class AnthropicTool(_Strict):
    type: Literal["custom"] | None = None  # (Anthropic's server tools, web search and the like, are not served)
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    # (accepted, not used: how Anthropic's platform loads and calls tools)
    cache_control: dict[str, Any] | None = None
    allowed_callers: list[Any] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: PositiveInt | None = None  # (accepted; the reasoning counts against max_tokens)
    display: Literal["summarized", "omitted"] | None = None  # omitted: no thinking blocks in the answer


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    model_config = ConfigDict(populate_by_name=True)

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's reasoning_effort
    format: JsonOutputFormat | None = None  # structured output


class MessagesRequest(_Strict):
    """POST /v1/messages."""

    model: str | None = None
    max_tokens: PositiveInt
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: Temperature01 | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: no limit
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # (accepted, not used)
    cache_control: dict[str, Any] | None = None  # (accepted, no effect: the prefix cache is automatic)

    @model_validator(mode="after")
    def _cross_field(self) -> MessagesRequest:
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if choice.name is None:
                raise custom_error("tool_choice of type 'tool' needs the tool's 'name'.", ("tool_choice", "name"))
            if choice.name not in {t.name for t in self.tools or ()}:
                raise custom_error(f"no tool named {show(choice.name)} in 'tools'.", ("tool_choice", "name"))
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise custom_error(f"tool_choice {show(choice.type)} needs 'tools'.", ("tool_choice",))
        return self


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completions request that asks what `req` asks."""
    body: dict[str, Any] = {"messages": chat_messages(req), "max_completion_tokens": req.max_tokens}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if req.tools:
        functions = [
            {"name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}
            for t in req.tools
        ]
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in f.items() if v is not None}} for f in functions
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        names = {"auto": "auto", "any": "required", "none": "none"}
        body["tool_choice"] = names.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        body["include_reasoning"] = req.thinking.display != "omitted"
    config = req.output_config
    if config is not None and config.effort is not None:  # (efforts past "high" are "high" to a template)
        body["reasoning_effort"] = config.effort if config.effort in ("low", "medium", "high") else "high"
    if config is not None and config.format is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": config.format.schema_},
        }
    return body


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """System and messages as chat messages (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    if req.system:
        text = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        out.append({"role": "system", "content": text})
    for message in req.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        blocks = message.content
        for block in blocks:
            if block.type == "tool_result":
                text = block.result_text
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        text = "\n".join(b.text or "" for b in blocks if b.type == "text")
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks
            if b.type == "tool_use"
        ]
        if calls:
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif text or not any(b.type == "tool_result" for b in blocks):
            out.append({"role": message.role, "content": text})
    return out


def parse_messages_request(raw: Any, limits: RequestCaps) -> Translated:
    """The parsed JSON body of POST /v1/messages -> its chat request, or a RequestError (400)."""
    req, ignored = parse_body(MessagesRequest, raw, limits)
    chat = parse_as_chat(chat_body(req), limits, RENAMES)
    return Translated(chat, message_answer, message_events, ignored, RENAMES)
