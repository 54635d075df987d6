"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, overload refusal, lifespan.

Owns HTTP concerns only. Bodies are read as raw JSON and validated by `protocol` (so every bad input
is a 400 in OpenAI's shape, never FastAPI's 422), the work is done by `serving.Server`, and the
AsyncEngine's thread is started and stopped with the app. `/openapi.json` documents the request and
response schemas.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from tokenmill.server.chat_protocol import ChatCompletionRequest, parse_chat_request
from tokenmill.server.openapi import constrain
from tokenmill.server.protocol import (
    CompletionRequest,
    RequestError,
    parse_completion_request,
    parse_model,
)
from tokenmill.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from tokenmill.server.serving import Job, Server
from tokenmill.server.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

RETRY_AFTER_SECONDS = 1
IGNORED_FIELDS_HEADER = "x-tokenmill-ignored-fields"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer (never seen by it)
T = TypeVar("T")


def ignored_fields_header(names: list[str], limit: int = 1024) -> str:
    """The ignored field names, comma-separated, percent-encoded (a header is ASCII), at most `limit`
    characters (then an ellipsis)."""
    text = ",".join(quote(name, safe="") for name in names)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def until_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, the result) of `work`, or (False, None) once the client has gone away first — then
    `work` is cancelled, which closes the engine streams it opened and so aborts their requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _sse_event(chunk_model: str) -> dict[str, Any]:
    """One server-sent event of a stream: its data a JSON chunk (or an error object), then `[DONE]`."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "description": f"a {chunk_model} as JSON, an OpenAI error object as JSON, or [DONE] at the end",
                "contentMediaType": "application/json",
            },
        },
    }


def _documented(request_model: type, response_model: type, stream: bool = True) -> dict[str, Any]:
    """OpenAPI for a route whose body the handler reads itself (so that errors keep OpenAI's shape)."""
    stream_model = "ChatCompletionChunk" if response_model.__name__.startswith("Chat") else "CompletionStreamResponse"
    if not stream:
        ok = {"application/json": {"schema": {"$ref": f"#/components/schemas/{response_model.__name__}"}}}
        return {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request_model.__name__}"}}},
            },
            "responses": {"200": {"description": "OK", "content": ok}, "400": _error_doc("Invalid request")},
        }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request_model.__name__}"}}},
        },
        "responses": {
            "200": {
                "description": "The completion (JSON), or server-sent events when stream is true.",
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{response_model.__name__}"}},
                    "text/event-stream": {"schema": _sse_event(stream_model)},
                },
            },
            **{
                code: {
                    "description": desc,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                }
                for code, desc in (
                    ("400", "Invalid request"),
                    ("401", "Missing or wrong API key"),
                    ("429", "Too many requests waiting"),
                    ("503", "Shutting down"),
                )
            },
        },
    }


class ApiKeyCheck:
    """Refuses /v1/ requests without 'Authorization: Bearer <key>' (401). A plain ASGI middleware:
    it leaves `receive` alone, so a handler still hears its client disconnect (Starlette's
    BaseHTTPMiddleware reports a disconnect to the app once the response has started)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if given != self.expected:
                response = error_response(
                    401,
                    "Missing or wrong API key (send 'Authorization: Bearer <key>').",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_doc(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    engine: AsyncEngine = server.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="tokenmill", version="0.1.0", lifespan=lifespan)

    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(EngineOverloaded)
    async def overloaded(_: Request, e: EngineOverloaded) -> JSONResponse:
        return error_response(
            429,
            f"The server is busy: {e}. Retry later.",
            "rate_limit_error",
            None,
            "too_many_requests",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, e: EngineUnavailable) -> JSONResponse:
        return error_response(
            503,
            f"Unavailable: {e}.",
            "service_unavailable",
            None,
            e.code,
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"Internal error ({type(e).__name__}).", "internal_error")

    async def read_json(request: Request) -> Any:
        body = await request.body()
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"The body is not valid JSON ({e}).", None, "invalid_json") from None

    async def respond(request: Request, req: CompletionRequest | ChatCompletionRequest, job: Job) -> Response:
        """Run a job until it answers or its client goes away (then every engine request it started is
        aborted and nothing is sent)."""
        headers = {}
        if req.ignored_fields:
            server.note_ignored(req.ignored_fields)
            headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(req.ignored_fields)
        answered, result = await until_disconnected(request, server.stream(job) if req.stream else server.complete(job))
        if not answered:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if req.stream:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(result, media_type="text/event-stream", headers=headers)
        return JSONResponse(result, headers=headers)

    @app.post("/v1/completions", openapi_extra=_documented(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        req = parse_completion_request(await read_json(request), server.limits)
        return await respond(request, req, server.prepare_completion(req))

    @app.post("/v1/chat/completions", openapi_extra=_documented(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        req = parse_chat_request(await read_json(request), server.limits)
        return await respond(request, req, server.prepare_chat(req))

    @app.post("/tokenize", openapi_extra=_documented(TokenizeRequest, TokenizeResponse, stream=False))
    async def tokenize_route(request: Request) -> Response:
        req = parse_model(TokenizeRequest, await read_json(request))
        return JSONResponse(tokenize(req, server.tokenizer, server.max_model_len))

    @app.post("/detokenize", openapi_extra=_documented(DetokenizeRequest, DetokenizeResponse, stream=False))
    async def detokenize_route(request: Request) -> Response:
        req = parse_model(DetokenizeRequest, await read_json(request))
        return JSONResponse(detokenize(req, server.tokenizer, server.engine.processor.limits.vocab_size))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=server.model_name, created=0, max_model_len=server.max_model_len)])

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "Serving (empty body)"},
            503: _error_doc("Shutting down, or the engine failed"),
        },
    )
    async def health() -> Response:
        if engine.accepting:
            return Response(status_code=200)
        why = "The server is shutting down." if engine.healthy else "The engine is not running."
        return error_response(503, why, "service_unavailable", None, None, {"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (
                CompletionRequest,
                ChatCompletionRequest,
                CompletionResponse,
                ChatCompletionResponse,
                ErrorResponse,
                TokenizeRequest,
                TokenizeResponse,
                DetokenizeRequest,
                DetokenizeResponse,
            ):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            vocab_size = server.engine.processor.limits.vocab_size
            constrain(components, server.model_name, server.max_model_len, server.limits, vocab_size)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
