"""The OpenAI-compatible response schemas and the pure builders that fill them from engine outputs.

Owns the response models (completions, chat, their stream chunks, the models list, the error body)
and the builders from `TokenLogprob`s / `RequestOutput`s: logprobs in each endpoint's format, usage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.outputs import RequestOutput, TokenLogprob
from tokenmill.server.tools import ToolCall

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: logprobs below this are reported as this (as vLLM does)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed completion: each choice carries the text added since the last."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


def _absent(value: Any) -> bool:
    return value is None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=_absent)  # with a reasoning parser
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a message; unset keys are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent)
    content: str | None = Field(default=None, exclude_if=_absent)
    reasoning_content: str | None = Field(default=None, exclude_if=_absent)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_absent)  # (server/tool_stream.py)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (documents `RequestError.body()`)."""

    error: ErrorInfo


# ------------------------------------------------------------------------------------------- builders


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    token_text: Callable[[int], str],
    text_offset_start: int,
    token_ids: Sequence[int] | None = None,
) -> CompletionLogprobs:
    """The legacy completions `logprobs` object. Each top-logprobs dict holds the top alternatives and
    the chosen token (as vLLM does). An entry may be None (the first prompt token, when echoing): its
    logprob and top dict are null, and its id comes from `token_ids` (one id per entry)."""
    if token_ids is not None and len(token_ids) != len(entries):
        raise ValueError(f"token_ids: expected one id per entry ({len(entries)}), got {len(token_ids)}")
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = text_offset_start
    for i, entry in enumerate(entries):
        if entry is None:
            if token_ids is None:
                raise ValueError(f"token_ids: needed for entry {i}, which is None")
            text = token_text(token_ids[i])
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = token_text(entry.token_id)
            out.token_logprobs.append(_logprob(entry.logprob))
            top = {token_text(tid): _logprob(lp) for tid, lp in entry.top}
            top.setdefault(text, _logprob(entry.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> ChatLogprobs:
    """The chat `logprobs` object: per generated token its text, logprob, UTF-8 bytes and top alternatives."""

    def top(tid: int, lp: float) -> TopLogprob:
        text = token_text(tid)
        return TopLogprob(token=text, logprob=_logprob(lp), bytes=list(text.encode("utf-8")))

    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_logprob(entry.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[top(tid, lp) for tid, lp in entry.top],
            )
        )
    return ChatLogprobs(content=content)


def usage_info(outputs: Sequence[RequestOutput], completion_tokens: int | None = None) -> UsageInfo:
    """Token counts over the outputs of one HTTP request (one RequestOutput per prompt; n choices
    each): completion tokens counted from those final outputs, or given (a stream of deltas)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = (
        sum(len(c.token_ids) for o in outputs for c in o.outputs) if completion_tokens is None else completion_tokens
    )
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs)),
    )
