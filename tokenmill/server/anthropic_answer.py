"""Anthropic's Messages API, the way back: a chat answer as an Anthropic message, a chat stream as
Anthropic's events, and every error of `/v1/messages` in Anthropic's shape.

- The message: `content` blocks (`thinking` with a reasoning parser, `text`, one `tool_use` per call,
  its input the call's arguments as an object), `stop_reason` (end_turn, max_tokens, stop_sequence with
  the `stop_sequence` that matched, tool_use) and `usage` (input tokens besides those read from the
  prefix cache, which are `cache_read_input_tokens`; output tokens).
- The stream: `message_start`, a `ping`, then per block `content_block_start`, its
  `content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`,
  then `message_delta` (the stop reason, the output tokens) and `message_stop`; a failure mid-stream
  is an `error` event.
- Errors: `{"type": "error", "error": {"type": ..., "message": ...}}`, the type from the status
  (`AnthropicErrors`, an ASGI layer around the app, rewrites the OpenAI-shaped error bodies of
  `/v1/messages`: the handlers', the API-key check's, the body limit's and the last-resort 500's).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.caps import parse_json
from tokenmill.server.translation import sse

PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


def _absent(value: Any) -> bool:
    return value is None


class AnthropicBlock(BaseModel):
    """A block of the answer: text, thinking (with its signature, empty here) or a tool_use."""

    type: Literal["text", "thinking", "tool_use"]
    text: str | None = Field(default=None, exclude_if=_absent)
    thinking: str | None = Field(default=None, exclude_if=_absent)
    signature: str | None = Field(default=None, exclude_if=_absent)
    id: str | None = Field(default=None, exclude_if=_absent)
    name: str | None = Field(default=None, exclude_if=_absent)
    input: dict[str, Any] | None = Field(default=None, exclude_if=_absent)


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error of /v1/messages."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def message_id(request_id: str) -> str:
    return "msg_" + request_id.partition("-")[2]


def stop_of(choice: dict[str, Any] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's end."""
    if choice is None:
        return "end_turn", None
    reason, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(reason or "", "end_turn"), None


def usage_of(chat_usage: dict[str, Any] | None) -> AnthropicUsage:
    usage = chat_usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return AnthropicUsage(
        input_tokens=usage.get("prompt_tokens", 0) - cached,
        output_tokens=usage.get("completion_tokens", 0),
        cache_read_input_tokens=cached,
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use's `input` is (arguments that are not an object: under "arguments")."""
    try:
        value = parse_json(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def message_answer(chat: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A whole chat answer (one choice) as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    blocks = []
    if message.get("reasoning_content") is not None:
        blocks.append(AnthropicBlock(type="thinking", thinking=message["reasoning_content"], signature=""))
    if message.get("content"):
        blocks.append(AnthropicBlock(type="text", text=message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            AnthropicBlock(
                type="tool_use", id=call["id"], name=function["name"], input=tool_input(function["arguments"])
            )
        )
    stop_reason, stop_sequence = stop_of(choice)
    return AnthropicMessageResponse(
        id=message_id(request_id),
        model=chat["model"],
        content=blocks,
        stop_reason=stop_reason,  # type: ignore[arg-type]
        stop_sequence=stop_sequence,
        usage=usage_of(chat.get("usage")),
    ).model_dump(mode="json")


class _Blocks:
    """The blocks of a streamed answer: which one is open (thinking or text deltas extend it) and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def close(self) -> Iterator[str]:
        if self.open is not None:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self.index += 1
        self.open = block["type"]
        yield sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, kind: str, text: str) -> Iterator[str]:
        if self.open != kind:
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text"}
            yield from self.start(start | ({"text": ""} if kind == "text" else {}))
        yield self.delta(
            {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        )

    def tool(self, call: dict[str, Any]) -> Iterator[str]:
        """A chat stream's call delta: its first (id, name) opens a tool_use block, each fragment of its
        arguments is an input_json_delta; the block closes when the next one starts, or at the end."""
        function = call["function"]
        if call.get("id"):
            yield from self.start({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
        if function.get("arguments"):
            yield self.delta({"type": "input_json_delta", "partial_json": function["arguments"]})


async def message_events(
    chunks: AsyncIterator[dict[str, Any]], request_id: str, prompt_tokens: int
) -> AsyncIterator[str]:
    """A chat stream (its chunks, then the usage chunk) as Anthropic's stream of events."""
    first = await anext(chunks, None)
    model = (first or {}).get("model", "")
    start = {"id": message_id(request_id), "type": "message", "role": "assistant", "model": model, "content": []}
    start |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield sse("message_start", {"type": "message_start", "message": start})
    yield sse("ping", {"type": "ping"})
    blocks, end, usage = _Blocks(), None, None
    pending = [first] if first is not None else []
    async for chunk in _chained(pending, chunks):
        if "error" in chunk:
            yield sse("error", {"type": "error", "error": {"type": "api_error", "message": chunk["error"]["message"]}})
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                for event in blocks.text("thinking", delta["reasoning_content"]):
                    yield event
            if delta.get("content"):
                for event in blocks.text("text", delta["content"]):
                    yield event
            for call in delta.get("tool_calls") or []:
                for event in blocks.tool(call):
                    yield event
            if choice.get("finish_reason") is not None:
                end = choice
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = stop_of(end)
    output = usage_of(usage).output_tokens
    yield sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output},
        },
    )
    yield sse("message_stop", {"type": "message_stop"})


async def _chained(first: list[dict[str, Any]], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for item in first:
        yield item
    async for item in rest:
        yield item


def anthropic_error(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's (the field it names, if any, leads the message)."""
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace"), None
    if param and param not in message:
        message = f"{param}: {message}"
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=message)).model_dump_json().encode()


class AnthropicErrors:
    """The error responses of `/v1/messages` rewritten in Anthropic's shape (a plain ASGI layer: a
    success, streamed or not, passes untouched; an error's body is read whole, it is small)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            out = anthropic_error(start["status"], b"".join(body))
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")
            ]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": out})

        await self.app(scope, receive, rewrite)
