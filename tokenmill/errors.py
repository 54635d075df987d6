"""Errors that cross module boundaries carrying what they are about.

`ParamError` is a request's own fault, raised where a value is checked (sampling parameters, the
output processor's admission checks, the engine's request checks) and carrying the request field it
names, so the server maps it to OpenAI's 400 with `param` set without reading the message text. It is
a `ValueError`, so offline callers that catch `ValueError` keep working.

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


class RequestFailed(RuntimeError):
    """The engine failed this request alone (an error in its own processing or in a step it was
    part of); the message says what happened, `request_id` which request."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


def describe(what: str, error: BaseException) -> str:
    """`what` happened, with the error's type and message: the text of a RequestFailed."""
    return f"{what} ({type(error).__name__}: {error})"
