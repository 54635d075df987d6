"""OpenAI's Responses API, stateless: `POST /v1/responses`, its request schema and its translation onto
the chat path (the answer and the stream: responses_api_answer.py; not to be confused with
responses.py, the chat and completions answers' schemas).

What a request may hold: `input` (a string, or items: messages of role user / assistant / system /
developer whose content is a string or `input_text` / `output_text` parts, `function_call`s and their
`function_call_output`s; `reasoning` items sent back are dropped), `instructions` (a system message
first), `tools` (functions: `name`, `description`, `parameters`, `strict`), `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema: structured output),
`max_output_tokens`, `temperature`, `top_p`, `top_k`, `reasoning.effort` (the chat template's
`reasoning_effort`), `stream`, `metadata`, `user`. Nothing is stored: `store: true`,
`previous_response_id`, `conversation` and `background: true` are refused with a 400 that says so.
Strict as the chat request is; unknown fields are ignored and listed (refused with --strict-fields).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tokenmill.server.chat_protocol import ReasoningEffort
from tokenmill.server.protocol import NonEmptyStr, PositiveInt, Temperature, TopP, _Strict
from tokenmill.server.responses_api_answer import Echo, response_answer, response_events
from tokenmill.server.translation import Translated, parse_as_chat, parse_body, validate_part
from tokenmill.server.validation import RequestCaps, RequestError, custom_error, show

RENAMES = (  # a chat field's path -> this API's
    (r"^messages\b.*", "input"),
    (r"^max_completion_tokens\b", "max_output_tokens"),
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format\b", "text.format"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].parameters"),
    (r"^tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
    (r"^reasoning_effort\b", "reasoning.effort"),
)
STATELESS = "this server keeps no responses (the Responses API is served stateless)"


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (accepted, no effect)


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # (accepted, no summaries are written)


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: Literal[False] | None = None
    previous_response_id: None = None
    conversation: None = None
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = None  # (accepted, not used)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            for name, refused in (("store", True), ("background", True)):
                if raw.get(name) is refused:
                    raise custom_error(f"'{name}: true' is not supported: {STATELESS}.", (name,), "unsupported_field")
            for name in ("previous_response_id", "conversation"):
                if raw.get(name) is not None:
                    raise custom_error(f"'{name}' is not supported: {STATELESS}.", (name,), "unsupported_field")
        return raw

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """Each item validated as its type, so that a refusal names it (`input[2].call_id`)."""
        if not isinstance(value, list):
            return value
        items = []
        for i, raw in enumerate(value):
            kind = raw.get("type", "message") if isinstance(raw, dict) else None
            model = ITEMS.get(kind) if isinstance(kind, str) else None
            if model is None:
                detail = f"expected an item of type {', '.join(ITEMS)}, got {show(kind if kind else raw)}."
                raise custom_error(detail, (i, "type") if isinstance(raw, dict) else (i,))
            items.append(validate_part(model, raw, (i,)))
        return items

    @model_validator(mode="after")
    def _cross_field(self) -> ResponsesRequest:
        choice = self.tool_choice
        if choice is not None and choice != "none" and choice != "auto" and not self.tools:
            raise custom_error(
                f"tool_choice {show(choice if isinstance(choice, str) else choice.name)} needs 'tools'.",
                ("tool_choice",),
            )
        if isinstance(choice, NamedFunction) and choice.name not in {t.name for t in self.tools or ()}:
            raise custom_error(f"no tool named {show(choice.name)} in 'tools'.", ("tool_choice", "name"))
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and (fmt.schema_ is None or fmt.name is None):
            raise custom_error("type 'json_schema' needs 'name' and 'schema'.", ("text", "format"))
        return self


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request that asks what `req` asks."""
    body: dict[str, Any] = {"messages": chat_messages(req)}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", "top_k", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: v for k, v in schema.items() if v is not None},
        }
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return body


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Instructions and input as chat messages: consecutive function calls are one assistant message's
    tool_calls (after its text, when an assistant message comes just before them)."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    previous: str | None = None
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and previous in ("message", "function_call"):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        previous = item.type or "message"
    if not out:
        raise RequestError(
            "Invalid value for 'input': it holds no message (only reasoning items).", "input", "invalid_value"
        )
    return out


def parse_responses_request(raw: Any, limits: RequestCaps) -> Translated:
    """The parsed JSON body of POST /v1/responses -> its chat request, or a RequestError (400)."""
    req, ignored = parse_body(ResponsesRequest, raw, limits)
    chat = parse_as_chat(chat_body(req), limits, RENAMES)
    echo = Echo(
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature if req.temperature is not None else 1.0,
        top_p=req.top_p if req.top_p is not None else 1.0,
        tool_choice=req.tool_choice.model_dump()
        if isinstance(req.tool_choice, NamedFunction)
        else req.tool_choice or "auto",
        tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
        text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None
        else {"format": {"type": "text"}},
        metadata=req.metadata or {},
        user=req.user,
    )
    answer, events = functools.partial(response_answer, echo), functools.partial(response_events, echo)
    return Translated(chat, answer, events, ignored, RENAMES)
