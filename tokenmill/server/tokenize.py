"""`/tokenize` and `/detokenize`, in vLLM's shapes: text (or chat messages) to the model's token ids
and back, with the count and the model's maximum length, so that a client can budget a prompt."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.server.chat_protocol import ChatMessageParam, conversation
from tokenmill.server.protocol import TokenId, _Strict
from tokenmill.server.validation import RequestError, custom_error


class TokenizeRequest(_Strict):
    """POST /tokenize: `prompt` (completions) or `messages` (chat, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # for a prompt: BOS and the like, as /v1/completions adds them
    add_generation_prompt: bool = True  # for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise custom_error("send exactly one of 'prompt' or 'messages'.", ("prompt",), whole=True)
        return self


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Strict):
    prompt: str


def tokenize(req: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    if req.messages is not None:
        try:
            ids = tokenizer.apply_chat_template(conversation(req.messages), req.add_generation_prompt)
        except ValueError as e:
            raise RequestError(str(e), "messages", "invalid_value") from None
    else:
        ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs).model_dump()


def detokenize(req: DetokenizeRequest, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"Invalid value for 'tokens[{bad}]': token id {req.tokens[bad]} is outside the vocabulary ({vocab_size}).",
            f"tokens[{bad}]",
            "invalid_value",
        )
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()
