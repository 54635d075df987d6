"""The app's outer ASGI layers: the body-size limit (413) and the last-resort error handler (an
OpenAI-shaped 500 with a request id; the traceback goes to the log, never to the client).

Plain ASGI middlewares, not Starlette's BaseHTTPMiddleware: they leave `receive` a stream, so a
handler still hears its client disconnect, and a body is never buffered here.
"""

from __future__ import annotations

import json
import logging
import uuid

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.validation import RequestError

logger = logging.getLogger("tokenmill")


def too_large(limit: int) -> RequestError:
    return RequestError(
        f"The request body is larger than {limit} bytes (--max-body-bytes).", None, "body_too_large", 413
    )


async def send_error(send: Send, error: RequestError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """`error` as a whole JSON response, sent from a middleware (before any handler answered)."""
    body = json.dumps(error.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses a body over `limit` bytes with a 413: at once when its Content-Length says so, else
    (chunked encoding) when the chunks read so far pass it. The handler reading the body then gets
    the 413 as a RequestError; nothing past the limit is held. (The server closes the connection
    after a response to a body it did not read to its end.)"""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await send_error(send, too_large(self.limit))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large(self.limit)
            return message

        await self.app(scope, counted, send)


class InternalErrors:
    """Any exception a handler lets out: logged with its traceback under a fresh request id, and
    answered (if nothing was sent yet) with a 500 in OpenAI's shape naming that id. A client that
    went away while its body was read is no error: nothing is logged or sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:
            logger.debug("client gone before its body was read: %s %s", scope["method"], scope["path"])
        except Exception:
            request_id = uuid.uuid4().hex[:16]
            logger.exception("internal error (request id %s) in %s %s", request_id, scope["method"], scope["path"])
            if not started:
                error = RequestError(f"internal error (request id {request_id})", None, None, 500, "server_error")
                await send_error(send, error, [(b"x-request-id", request_id.encode())])
