"""`/tokenize` and `/detokenize`, in vLLM's shapes: text (or chat messages) to the model's token ids
and back, with the count and the model's maximum length, so that a client can budget a prompt.

Both run on the app's thread pool. A 20 MB prompt is millions of ids: the answer is rendered in
chunks (`render`), so that the event loop's thread, waiting for the GIL meanwhile, gets it between
them rather than after one long `json.dumps`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, model_validator

from tokenmill.server.chat_protocol import ChatMessageParam, conversation
from tokenmill.server.protocol import TokenId, _Strict
from tokenmill.server.validation import RequestError, custom_error
from tokenmill.text.tokenizer import Tokenizer


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
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"Invalid value for 'tokens[{bad}]': token id {req.tokens[bad]} is outside the vocabulary ({vocab_size}).",
            f"tokens[{bad}]",
            "invalid_value",
        )
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()


RENDER_CHUNK = 16384  # list items per json.dumps call: a few milliseconds holding the GIL


def render(payload: dict[str, Any]) -> bytes:
    """`payload` as compact JSON (as a JSONResponse renders it), its long lists a chunk at a time."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, list) and len(value) > RENDER_CHUNK:
            chunks = (_dumps(value[i : i + RENDER_CHUNK])[1:-1] for i in range(0, len(value), RENDER_CHUNK))
            text = "[" + ",".join(chunks) + "]"
        else:
            text = _dumps(value)
        parts.append(f"{_dumps(key)}:{text}")
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
