"""Errors that cross module boundaries carrying what they are about.

`ParamError` is a request's own fault, raised where a value is checked (sampling parameters, the
engine's front door `engine.request_checks`) and carrying the request field it names, so the server
maps it to OpenAI's 400 with `param` set without reading the message text. It is a `ValueError`, so
offline callers that catch `ValueError` keep working. Three refusals carry their figures too
(`EmptyPrompt`, `TokenOutsideVocabulary`, `ContextTooLong`), for the server's own wording of them.

`RequestFailed` is what a request's stream raises when the engine failed that request alone (its
processor, its grammar, a step it was in): the engine goes on serving the others.
"""

from __future__ import annotations


class ParamError(ValueError):
    """A request field with a value the engine refuses; `param` names the field (`logit_bias`,
    `structured_outputs.json`, `prompt`, ...), `str()` is the whole message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EmptyPrompt(ParamError):
    """A prompt of no tokens."""

    def __init__(self) -> None:
        super().__init__("prompt", "prompt: must not be empty")


class TokenOutsideVocabulary(ParamError):
    """A prompt token id that is no integer of the model's vocabulary; `token_id` the first such."""

    def __init__(self, token_id: object, vocab_size: int) -> None:
        super().__init__("prompt", f"prompt: token ids must be integers in [0, {vocab_size})")
        self.token_id = token_id
        self.vocab_size = vocab_size


class ContextTooLong(ParamError):
    """A prompt and the tokens asked for that do not fit the model's length. `max_tokens`: as the
    request asked (None: as many as fit), `param` "prompt" when the prompt alone leaves no room."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        if num_prompt_tokens >= max_model_len:
            param, message = (
                "prompt",
                (
                    f"prompt: {num_prompt_tokens} tokens leave no room to generate within the maximum model length "
                    f"({max_model_len})"
                ),
            )
        else:
            param, message = (
                "max_tokens",
                (
                    f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                    f"exceeds the maximum model length ({max_model_len})"
                ),
            )
        super().__init__(param, message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class RequestFailed(RuntimeError):
    """The engine failed this request alone (an error in its own processing or in a step it was
    part of); the message says what happened, `request_id` which request."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


def describe(what: str, error: BaseException) -> str:
    """`what` happened, with the error's type and message: the text of a RequestFailed."""
    return f"{what} ({type(error).__name__}: {error})"
