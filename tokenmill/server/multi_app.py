"""The several-model server's app: `tokenmill serve --models FILE | --models-dir DIR`.

Each model, once loaded, is served by the very app `tokenmill serve MODEL` serves (`create_app`, see
served_model.py); this app stands in front of them. A POST's JSON body names its model (`model`; left
out, the only model of a one-model catalog): the request takes a lease on it from the pool (loading
it on demand, waiting up to --load-wait, then a 503 with Retry-After), and is handed, body and all,
to that model's app, which answers it exactly as a one-model server would (every endpoint: chat,
completions, embeddings, rerank, messages, responses, tokenize). A client that goes away while its
model loads is answered nothing and holds nothing; the load goes on, for the retry.

Its own routes: `GET /v1/models` (every model with its `state`: loaded, loading, unloading or
unloaded, and its memory estimate and last load and unload times), `GET /v1/models/{name}`,
`POST /v1/models/{name}/load` and `/unload`, `/health`, and `/metrics` (the pool's series and every
model's engine series, labelled `model_name`). The API key, body limit and error shapes are the
one-model app's, applied here as well.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.config import EngineConfig
from tokenmill.model_files import is_gguf
from tokenmill.server.anthropic_answer import AnthropicErrors
from tokenmill.server.app import (
    CLIENT_CLOSED_REQUEST,
    RETRY_AFTER_SECONDS,
    add_error_handlers,
    error_response,
    until_disconnected,
)
from tokenmill.server.auth import ApiKeyCheck
from tokenmill.server.front_door import ConnectionLimits, FrontDoor, parse_api_keys
from tokenmill.server.json_body import parse_json
from tokenmill.server.middleware import BodyLimit, InternalErrors
from tokenmill.server.model_catalog import ModelSpec, parse_bytes, read_models_file, scan_models_dir
from tokenmill.server.model_pool import (
    Lease,
    ModelEntry,
    ModelLoadFailed,
    ModelNotFound,
    ModelNotReady,
    ModelPool,
    PoolSettings,
)
from tokenmill.server.pool_metrics import render
from tokenmill.server.settings import ServeSettings
from tokenmill.server.trace_recorder import TraceRecorder, model_trace_paths
from tokenmill.server.validation import RequestError

logger = logging.getLogger("tokenmill")
INLINE_PARSE_BYTES = 65536  # bodies up to this size are read for their model on the event loop
ROUTING_KEYS = ("route", "endpoint", "path_params", "router", "app")  # this app's, not the model app's


class Forwarded(Response):
    """A request handed to its model's app with the body already read; the lease given back once the
    model's app has sent the whole response (a stream included)."""

    def __init__(self, lease: Lease, body: bytes) -> None:
        super().__init__()
        self.lease, self.request_body = lease, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:  # the body once; then the client's own messages (its disconnect)
                replayed = True
                return {"type": "http.request", "body": self.request_body, "more_body": False}
            return dict(await receive())

        inner = {k: v for k, v in scope.items() if k not in ROUTING_KEYS}
        try:
            await self.lease.model.app(inner, replay, send)
        finally:
            self.lease.release()


def requested_model(body: bytes, names: Sequence[str], max_depth: int) -> str:
    """The model a POST body names: its `model`; left out, the only model there is (else a 400)."""
    value = parse_json(body, max_depth)
    model = value.get("model") if isinstance(value, dict) else None
    if model is None:
        if len(names) == 1:
            return names[0]
        raise RequestError(
            f"model: required on this server, which serves {', '.join(names)}.", "model", "model_required"
        )
    if not isinstance(model, str):
        raise RequestError(f"model: expected a string, got {type(model).__name__}.", "model", "invalid_type")
    return model


def model_card(entry: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object, with the pool's state of the model as extra fields."""
    spec, served = entry.spec, entry.served
    max_len = served.server.max_model_len if served is not None else declared_max_model_len(spec.config)
    return {
        "id": spec.name,
        "object": "model",
        "created": 0,
        "owned_by": "tokenmill",
        "max_model_len": max_len,
        "state": entry.state,
        "memory_bytes": entry.memory_bytes,
        "load_seconds": entry.load_seconds,
        "unload_seconds": entry.unload_seconds,
        "load_error": entry.error,
    }


def declared_max_model_len(config: EngineConfig) -> int | None:
    """The model length a model will have, from its settings and config.json (None: not known before
    loading, as for a GGUF file)."""
    if is_gguf(config.model):
        return config.max_model_len
    try:
        limit = json.loads((Path(config.model) / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    except (OSError, ValueError, KeyError):
        return config.max_model_len
    return min(config.max_model_len or limit, limit)


def create_multi_app(pool: ModelPool, front: FrontDoor) -> FastAPI:
    """The app in front of the pool's models (see the module docstring)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="tokenmill (several models)", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=front.max_body_bytes)
    app.add_middleware(ApiKeyCheck, keys=parse_api_keys(list(front.api_keys)), metrics_public=front.metrics_public)
    app.add_middleware(InternalErrors)
    app.add_middleware(AnthropicErrors)
    add_error_handlers(app)
    add_pool_errors(app)
    add_model_routes(app, pool)
    add_forwarding(app, pool, front)
    return app


def add_pool_errors(app: FastAPI) -> None:
    """An unknown model: 404; a model not ready in time: 503 with Retry-After; a failed load: 500."""

    @app.exception_handler(ModelNotFound)
    async def not_found(_: Request, e: ModelNotFound) -> JSONResponse:
        return error_response(404, str(e), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(ModelNotReady)
    async def not_ready(_: Request, e: ModelNotReady) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after)}
        return error_response(503, f"Unavailable: {e}.", "service_unavailable", "model", "model_loading", headers)

    @app.exception_handler(ModelLoadFailed)
    async def load_failed(_: Request, e: ModelLoadFailed) -> JSONResponse:
        return error_response(500, str(e), "server_error", "model", "model_load_failed")


def add_model_routes(app: FastAPI, pool: ModelPool) -> None:
    """GET /v1/models[/{name}], POST /v1/models/{name}/load and /unload, /health, /metrics."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(e) for e in pool.entries.values()]}

    @app.post("/v1/models/{name:path}/load")
    async def load(name: str) -> dict[str, Any]:
        return model_card(await pool.load(name))

    @app.post("/v1/models/{name:path}/unload")
    async def unload(name: str) -> dict[str, Any]:
        return model_card(await pool.unload(name))

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return model_card(pool.entry(name))

    @app.get("/health", response_class=Response)
    async def health() -> Response:
        if pool.accepting:
            return Response(status_code=200)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return error_response(503, "The server is shutting down.", "service_unavailable", None, None, headers)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        registries = [pool.metrics.registry, *(e.metrics.registry for e in pool.entries.values() if e.metrics)]
        return Response(render(registries), media_type="text/plain; version=0.0.4; charset=utf-8")


def add_forwarding(app: FastAPI, pool: ModelPool, front: FrontDoor) -> None:
    """Every other POST: to the app of the model its body names, once that model is loaded."""
    names = list(pool.entries)

    @app.post("/{path:path}", include_in_schema=False)
    async def forward(request: Request) -> Response:
        body = await request.body()
        if len(body) <= INLINE_PARSE_BYTES:
            name = requested_model(body, names, front.max_json_depth)
        else:
            name = await anyio.to_thread.run_sync(requested_model, body, names, front.max_json_depth)
        answered, lease = await until_disconnected(request, pool.acquire(name))
        if not answered or lease is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return Forwarded(lease, body)


def catalog(config: EngineConfig, settings: ServeSettings) -> list[ModelSpec]:
    """The models `--models` or `--models-dir` name, over the command line's engine settings."""
    if settings.models is not None and settings.models_dir is not None:
        raise ValueError("models: give --models or --models-dir, not both")
    if settings.models is not None:
        return read_models_file(settings.models, config)
    assert settings.models_dir is not None
    return scan_models_dir(settings.models_dir, config)


def pool_settings(settings: ServeSettings) -> PoolSettings:
    memory = parse_bytes(settings.memory, "memory") if settings.memory is not None else None
    if settings.idle_unload is not None and settings.idle_unload <= 0:
        raise ValueError(f"idle_unload: expected a positive number of seconds, got {settings.idle_unload}")
    if settings.load_wait <= 0:
        raise ValueError(f"load_wait: expected a positive number of seconds, got {settings.load_wait}")
    return PoolSettings(memory, settings.idle_unload, settings.load_wait, settings.drain_timeout)


def run_several(config: EngineConfig, settings: ServeSettings, front: FrontDoor, connections: ConnectionLimits) -> None:
    """Serve the models of `--models` / `--models-dir` until stopped (nothing loads before a request
    or an explicit load asks)."""
    from tokenmill.server.launch import serve_app

    if settings.data_parallel_size > 1 or settings.disaggregate is not None or settings.ray_address is not None:
        raise ValueError("models: one engine process per model; not with data_parallel_size, disaggregate or Ray")
    if settings.served_model_name is not None:
        raise ValueError("served_model_name: with --models a model's name is its key (with --models-dir, its folder's)")
    specs = catalog(config, settings)
    pool = ModelPool(specs, pool_settings(settings), settings, front)
    for spec in specs:
        logger.info("model %s: %s (about %.0f MiB loaded)", spec.name, spec.config.model, spec.memory_bytes / 2**20)
    busiest = sum(s.config.max_num_seqs for s in specs) + settings.max_waiting * len(specs)
    app = create_multi_app(pool, front)
    what = f"{len(specs)} models ({', '.join(s.name for s in specs)})"
    keyed = bool(front.api_keys)
    pool.traces = record_traces(specs, settings)
    try:
        serve_app(app, what, pool, settings.host, settings.port, keyed, settings.drain_timeout, connections, busiest)
    finally:
        for recorder in pool.traces.values():
            recorder.close()


def record_traces(specs: Sequence[ModelSpec], settings: ServeSettings) -> dict[str, TraceRecorder]:
    """`--record-trace FILE`: a recorder per model, each to its own file (`model_trace_path`)."""
    if settings.record_trace is None:
        return {}
    paths = model_trace_paths(settings.record_trace, [s.name for s in specs])
    recorders: dict[str, TraceRecorder] = {}
    try:
        for name, path in paths.items():
            recorders[name] = TraceRecorder(path, settings.record_trace_privacy, settings.record_trace_max_bytes, name)
            logger.info("model %s: recording finished requests to %s", name, path)
    except BaseException:
        for recorder in recorders.values():
            recorder.close()
        raise
    return recorders
