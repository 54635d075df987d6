"""The FastAPI app: routes, OpenAI-shaped errors, overload refusal, lifespan.

Owns HTTP concerns only. Around the routes: the API-key check (auth.py), the body-size limit and the
last-resort 500 (middleware.py). Bodies are read as raw JSON, checked (json_body.py) and validated by
`protocol` (so every bad input is a 400 in OpenAI's shape, never FastAPI's 422), the work is done by
`serving.Server`, and the AsyncEngine's thread is started and stopped with the app. The CPU work of a
request before the engine (JSON, validation, chat template, tokenization) runs on a thread pool, so
that a 20 MB prompt does not stall the event loop and the streams it serves. `/openapi.json`
documents the request and response schemas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from tokenmill.server.anthropic_answer import AnthropicErrors
from tokenmill.server.auth import ApiKeyCheck
from tokenmill.server.chat_protocol import ChatCompletionRequest, parse_chat_request
from tokenmill.server.front_door import FrontDoor, parse_api_keys
from tokenmill.server.json_body import parse_json
from tokenmill.server.middleware import BodyLimit, InternalErrors
from tokenmill.server.openapi import constrain
from tokenmill.server.pooling_protocol import POOLING_MODELS, constrain_pooling
from tokenmill.server.pooling_serving import add_pooling_routes
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
    render,
    tokenize,
)
from tokenmill.server.translated_routes import add_translated_routes, constrain_translated, translated_models

RETRY_AFTER_SECONDS = 1
IGNORED_FIELDS_HEADER = "x-tokenmill-ignored-fields"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer (never seen by it)
PREPARE_THREADS = 8  # requests parsed and tokenized at once, off the event loop
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
            "responses": {
                "200": {"description": "OK", "content": ok},
                "400": _error_doc("Invalid request"),
                "401": _error_doc("Missing or wrong API key"),
                "413": _error_doc("Request body too large"),
            },
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
                    ("413", "Request body too large"),
                    ("429", "Too many requests waiting"),
                    ("503", "Shutting down"),
                )
            },
        },
    }


def _error_doc(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def tenant_of(request: Request) -> str | None:
    """Who sent the request, for the cache isolation policy: a hash of the API key it was
    authenticated with (set by the auth check), None on a server without keys."""
    return getattr(request.state, "tenant", None)


def create_app(server: Server, api_key: str | Sequence[str] | None = None, front: FrontDoor | None = None) -> FastAPI:
    """The app serving `server`. `front`: its keys and input limits; `api_key` (one, or several) adds keys."""
    front = front or FrontDoor()
    extra_keys = [api_key] if isinstance(api_key, str) or api_key is None else list(api_key)
    keys = parse_api_keys([*front.api_keys, *extra_keys])
    engine: AsyncEngine = server.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="tokenmill", version="0.1.0", lifespan=lifespan)

    # the last added runs first: errors around everything, then the key, then the body's size
    app.add_middleware(BodyLimit, limit=front.max_body_bytes)
    app.add_middleware(ApiKeyCheck, keys=keys, metrics_public=front.metrics_public)
    app.add_middleware(InternalErrors)
    app.add_middleware(AnthropicErrors)  # (outermost: /v1/messages answers its errors in Anthropic's shape)
    add_error_handlers(app)
    handling = Handling(server, front, anyio.CapacityLimiter(PREPARE_THREADS))
    add_generation_routes(app, handling)
    add_token_routes(app, handling)
    add_pooling_routes(app, handling)  # /v1/embeddings, /v1/rerank, /v1/score (pooling_serving.py)
    add_translated_routes(app, handling)  # /v1/messages and /v1/responses, on the chat path
    add_status_routes(app, server)
    add_openapi(app, server)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape: a RequestError (400, ...), an HTTP error of the framework
    (404, 405, ...), the engine overloaded (429) or unavailable (503)."""

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


@dataclass
class Handling:
    """What the routes share: the server, the front door's limits, and the thread pool that runs a
    request's CPU work before the engine."""

    server: Server
    front: FrontDoor
    limiter: anyio.CapacityLimiter

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work` on the thread pool; a RecursionError in it (a parser or validator meeting deep input
        the depth limit let through) is the client's 400, not a 500."""

        def guarded() -> T:
            try:
                return work()
            except RecursionError:
                raise RequestError("The request nests too deep to process.", None, "nesting_too_deep") from None

        return await anyio.to_thread.run_sync(guarded, limiter=self.limiter)

    async def read_json(self, request: Request) -> Callable[[], Any]:
        """The body, read on the loop (bounded by BodyLimit); its parse, to run off it."""
        body = await request.body()
        return lambda: parse_json(body, self.front.max_json_depth)

    async def respond(self, request: Request, req: CompletionRequest | ChatCompletionRequest, job: Job) -> Response:
        """Run a job until it answers or its client goes away (then every engine request it started is
        aborted and nothing is sent)."""
        server, headers = self.server, {}
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


def add_generation_routes(app: FastAPI, handling: Handling) -> None:
    """POST /v1/completions and /v1/chat/completions."""
    server = handling.server

    @app.post("/v1/completions", openapi_extra=_documented(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[CompletionRequest, Job]:
            req = parse_completion_request(parsed(), server.limits)
            return req, server.prepare_completion(req, tenant)

        return await handling.respond(request, *await handling.off_loop(prepare))

    @app.post("/v1/chat/completions", openapi_extra=_documented(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        parsed, tenant = await handling.read_json(request), tenant_of(request)

        def prepare() -> tuple[ChatCompletionRequest, Job]:
            req = parse_chat_request(parsed(), server.limits)
            return req, server.prepare_chat(req, tenant)

        return await handling.respond(request, *await handling.off_loop(prepare))


def add_token_routes(app: FastAPI, handling: Handling) -> None:
    """POST /tokenize and /detokenize."""
    server = handling.server

    @app.post("/tokenize", openapi_extra=_documented(TokenizeRequest, TokenizeResponse, stream=False))
    async def tokenize_route(request: Request) -> Response:
        parsed = await handling.read_json(request)

        def answer() -> bytes:  # (rendered off the loop too: it can hold millions of ids)
            return render(tokenize(parse_model(TokenizeRequest, parsed()), server.tokenizer, server.max_model_len))

        return Response(await handling.off_loop(answer), media_type="application/json")

    @app.post("/detokenize", openapi_extra=_documented(DetokenizeRequest, DetokenizeResponse, stream=False))
    async def detokenize_route(request: Request) -> Response:
        parsed, vocab_size = await handling.read_json(request), server.engine.processor.limits.vocab_size
        return await handling.off_loop(
            lambda: JSONResponse(detokenize(parse_model(DetokenizeRequest, parsed()), server.tokenizer, vocab_size))
        )


def add_status_routes(app: FastAPI, server: Server) -> None:
    """GET /v1/models, /health and /metrics."""
    engine = server.engine

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


DOCUMENTED_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    CompletionResponse,
    ChatCompletionResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    *translated_models(),
)


def add_openapi(app: FastAPI, server: Server) -> None:
    """/openapi.json with the request and response schemas, constrained to this server's caps."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (*DOCUMENTED_MODELS, *POOLING_MODELS):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            vocab_size = server.engine.processor.limits.vocab_size
            constrain(components, server.model_name, server.max_model_len, server.limits, vocab_size)
            constrain_translated(components, server.model_name, server.max_model_len, server.limits)
            constrain_pooling(components, server.model_name, server.limits, vocab_size)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
