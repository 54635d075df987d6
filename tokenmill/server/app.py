"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, overload refusal, lifespan.

Owns HTTP concerns only. Bodies are read as raw JSON and validated by `protocol` (so every bad input
is a 400 in OpenAI's shape, never FastAPI's 422), the work is done by `serving.Server`, and the
AsyncEngine's thread is started and stopped with the app. `/openapi.json` documents the request and
response schemas.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    parse_chat_request,
    parse_completion_request,
)
from tokenmill.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from tokenmill.server.serving import Server

RETRY_AFTER_SECONDS = 1


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


def _documented(request_model: type, response_model: type) -> dict[str, Any]:
    """OpenAPI for a route whose body the handler reads itself (so that errors keep OpenAI's shape)."""
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
                    "text/event-stream": {"schema": {"type": "string"}},
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

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        path, given = request.url.path, request.headers.get("authorization", "")
        if api_key is not None and path.startswith("/v1/") and given != f"Bearer {api_key}":
            return error_response(
                401,
                "Missing or wrong API key (send 'Authorization: Bearer <key>').",
                "authentication_error",
                None,
                "invalid_api_key",
            )
        response: Response = await call_next(request)
        return response

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

    @app.exception_handler(EngineStopped)
    async def stopped(_: Request, e: EngineStopped) -> JSONResponse:
        return error_response(
            503,
            f"Unavailable: {e}.",
            "service_unavailable",
            None,
            "shutting_down",
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

    async def respond(job_stream: bool, job: Any) -> Response:
        if job_stream:
            events = await server.stream(job)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await server.complete(job))

    @app.post("/v1/completions", openapi_extra=_documented(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        req = parse_completion_request(await read_json(request), server.limits)
        return await respond(req.stream, server.prepare_completion(req))

    @app.post("/v1/chat/completions", openapi_extra=_documented(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        req = parse_chat_request(await read_json(request), server.limits)
        return await respond(req.stream, server.prepare_chat(req))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=server.model_name, created=0, max_model_len=server.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if engine.accepting:
            return Response(status_code=200)
        why = "The server is shutting down." if engine.healthy else "The engine is not running."
        return error_response(503, why, "service_unavailable", None, None, {"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get("/metrics")
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
            ):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
