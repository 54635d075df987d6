"""OpenAI's Responses API, the way back: a chat answer as a `response` object, a chat stream as the
Responses API's events.

- The response: `output` items (a `reasoning` item with a reasoning parser, a `message` with one
  `output_text` part, one `function_call` per call), `status` completed (or incomplete, with
  `incomplete_details.reason` max_output_tokens, when the answer was cut by its length), `usage`, and
  the request's settings echoed (instructions, tools, tool_choice, text, temperature, ...). Ids:
  `resp_`, `msg_`, `rs_`, `fc_` and the chat request's hex.
- The stream: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
  its parts and deltas (`response.reasoning_text.delta` / `.done`; `response.content_part.added`,
  `response.output_text.delta` / `.done`, `response.content_part.done`;
  `response.function_call_arguments.delta` / `.done`) and `response.output_item.done`; then
  `response.completed` (or `response.incomplete`) with the whole response. Each event carries its
  `sequence_number`. A failure mid-stream is `response.failed` with the error.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.server.translation import sse


@dataclass(frozen=True)
class Echo:
    """The request's settings a response repeats."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = field(default_factory=list)
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


def _absent(value: Any) -> bool:
    return value is None


class OutputItem(BaseModel):
    """An item of `output`: a message (its content), a reasoning item (its content, no summary) or a
    function call (call_id, name, arguments)."""

    type: Literal["message", "reasoning", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent)
    content: list[OutputText] | list[ReasoningText] | None = Field(default=None, exclude_if=_absent)
    summary: list[Any] | None = Field(default=None, exclude_if=_absent)
    call_id: str | None = Field(default=None, exclude_if=_absent)
    name: str | None = Field(default=None, exclude_if=_absent)
    arguments: str | None = Field(default=None, exclude_if=_absent)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any]
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = {}
    user: str | None = None


def _hex(request_id: str) -> str:
    return request_id.partition("-")[2]


def _usage(chat_usage: dict[str, Any] | None) -> ResponseUsage | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(
        input_tokens=chat_usage["prompt_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=chat_usage["completion_tokens"],
        total_tokens=chat_usage["total_tokens"],
    )


def _response(echo: Echo, request_id: str, model: str, status: str, output: list[OutputItem]) -> ResponseObject:
    settings = {k: getattr(echo, k) for k in Echo.__dataclass_fields__}
    incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    return ResponseObject(
        id=f"resp_{_hex(request_id)}",
        created_at=int(time.time()),
        status=status,  # type: ignore[arg-type]
        model=model,
        output=output,
        incomplete_details=incomplete,
        **settings,
    )


def _items(request_id: str, message: dict[str, Any]) -> list[OutputItem]:
    """A chat answer's message as output items."""
    items: list[OutputItem] = []

    def key() -> str:  # (as a stream numbers them: by their index in `output`)
        return f"{_hex(request_id)}_{len(items)}"

    if message.get("reasoning_content") is not None:
        reasoning = [ReasoningText(text=message["reasoning_content"])]
        items.append(OutputItem(type="reasoning", id=f"rs_{key()}", content=reasoning, summary=[]))
    if message.get("content"):
        content = [OutputText(text=message["content"])]
        items.append(OutputItem(type="message", id=f"msg_{key()}", role="assistant", content=content))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        item = OutputItem(type="function_call", id=f"fc_{key()}", call_id=call["id"], name=function["name"])
        item.arguments = function["arguments"]
        items.append(item)
    return items


def response_answer(echo: Echo, chat: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A whole chat answer (one choice) as a response object."""
    choice = chat["choices"][0]
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    response = _response(echo, request_id, chat["model"], status, _items(request_id, choice["message"]))
    response.usage = _usage(chat.get("usage"))
    return response.model_dump(mode="json")


@dataclass
class _Stream:
    """A streamed response being written: its events' numbering and the items so far."""

    echo: Echo
    request_id: str
    model: str = ""
    sequence: int = 0
    output: list[OutputItem] = field(default_factory=list)
    open: OutputItem | None = None  # the item text deltas (or a call's argument fragments) extend

    def event(self, kind: str, **payload: Any) -> str:
        self.sequence += 1
        return sse(kind, {"type": kind, "sequence_number": self.sequence - 1, **payload})

    def response(self, status: str) -> dict[str, Any]:
        return _response(self.echo, self.request_id, self.model, status, self.output).model_dump(mode="json")

    def text(self, kind: str, delta: str) -> list[str]:
        """Events for reasoning or answer text (`kind`: "reasoning" or "message")."""
        events = []
        if self.open is None or self.open.type != kind:
            events += self.close()
            events += self.add(kind)
        assert self.open is not None and self.open.content is not None
        self.open.content[0].text += delta
        where = {"item_id": self.open.id, "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", **where, delta=delta)]
        return [*events, self.event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def add(self, kind: str) -> list[str]:
        key = f"{_hex(self.request_id)}_{len(self.output)}"
        if kind == "reasoning":
            item = OutputItem(type="reasoning", id=f"rs_{key}", status="in_progress", content=[], summary=[])
        else:
            item = OutputItem(type="message", id=f"msg_{key}", status="in_progress", role="assistant", content=[])
        self.output.append(item)
        events = [
            self.event(
                "response.output_item.added", output_index=len(self.output) - 1, item=item.model_dump(mode="json")
            )
        ]
        part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
        if kind == "message":
            where = {"item_id": item.id, "output_index": len(self.output) - 1, "content_index": 0}
            events.append(self.event("response.content_part.added", **where, part=part.model_dump(mode="json")))
        item.content = [part]  # type: ignore[assignment]
        self.open = item
        return events

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is not None and item.type == "function_call":
            return self._close_call(item)
        if item is None or item.content is None:
            return []
        item.status = "completed"
        index, part = len(self.output) - 1, item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if item.type == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, text=part.text)]
        else:
            events = [
                self.event("response.output_text.done", **where, text=part.text, logprobs=[]),
                self.event("response.content_part.done", **where, part=part.model_dump(mode="json")),
            ]
        return [*events, self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))]

    def call(self, call: dict[str, Any]) -> list[str]:
        """A chat stream's call delta: its first (id, name) adds a function_call item, each fragment of its
        arguments is a function_call_arguments.delta; the item is done when the next starts, or at the end."""
        events: list[str] = []
        function = call["function"]
        if call.get("id"):
            events += self.close()
            item = OutputItem(
                type="function_call",
                id=f"fc_{_hex(self.request_id)}_{len(self.output)}",
                status="in_progress",
                call_id=call["id"],
                name=function["name"],
                arguments="",
            )
            self.output.append(item)
            self.open = item
            index = len(self.output) - 1
            events.append(
                self.event("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))
            )
        item = self.open
        fragment = function.get("arguments") or ""
        if fragment and item is not None and item.type == "function_call":
            item.arguments = (item.arguments or "") + fragment
            index = len(self.output) - 1
            events.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=fragment
                )
            )
        return events

    def _close_call(self, item: OutputItem) -> list[str]:
        item.status = "completed"
        index = len(self.output) - 1
        done = self.event(
            "response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=item.arguments
        )
        return [done, self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))]


async def response_events(
    echo: Echo, chunks: AsyncIterator[dict[str, Any]], request_id: str, prompt_tokens: int
) -> AsyncIterator[str]:
    """A chat stream (its chunks, then the usage chunk) as the Responses API's events."""
    stream = _Stream(echo, request_id)
    first = await anext(chunks, None)
    stream.model = (first or {}).get("model", "")
    yield stream.event("response.created", response=stream.response("in_progress"))
    yield stream.event("response.in_progress", response=stream.response("in_progress"))
    status, usage = "completed", None
    async for chunk in _chained(first, chunks):
        if "error" in chunk:
            failed = stream.response("failed")
            failed["error"] = {
                "code": chunk["error"].get("code") or "server_error",
                "message": chunk["error"]["message"],
            }
            yield stream.event("response.failed", response=failed)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            events: list[str] = []
            if delta.get("reasoning_content"):
                events += stream.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += stream.text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += stream.call(call)
            if choice.get("finish_reason") == "length":
                status = "incomplete"
            for event in events:
                yield event
    for event in stream.close():
        yield event
    final = stream.response(status)
    final["usage"] = _usage(usage).model_dump(mode="json") if usage is not None else None
    yield stream.event("response.completed" if status == "completed" else "response.incomplete", response=final)


async def _chained(first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
