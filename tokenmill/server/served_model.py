"""One model of a several-model server, loaded: its engine core in a child process, the front end here.

`load_model` (blocking: the pool runs it on a thread) waits for a spawned child to build its core,
then builds what a one-model server has around it: the AsyncEngine over the child's client (the
output processor and tokenizer in this process), the `Server` with the model's own served settings,
and the same FastAPI app `tokenmill serve MODEL` serves (`create_app`), to which the several-model
app forwards the model's requests. Nothing here steps a model: unloading is stopping the engine,
which ends the child process, and every byte of its weights and KV cache goes with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from tokenmill.engine import build_async_engine
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.server.app import create_app
from tokenmill.server.front_door import FrontDoor
from tokenmill.server.model_catalog import ModelSpec
from tokenmill.server.serving import Server
from tokenmill.server.settings import ServeSettings, request_caps


@dataclass
class ServedModel:
    """A loaded model: its server (engine, tokenizer, settings) and the app serving it."""

    server: Server
    app: FastAPI
    metrics: EngineMetrics
    pid: int  # the child process running its core

    @property
    def engine(self) -> AsyncEngine:
        return self.server.engine


def load_model(spec: ModelSpec, child: Any, settings: ServeSettings, front: FrontDoor) -> ServedModel:
    """The served model around `child` (a spawned `CoreProcess`) once its core is built; raises the
    child's `CoreLoadFailed` when it is not. `settings`: the server's, under the model's own."""
    client = child.wait_ready()
    try:
        served = dataclasses.replace(settings, **spec.served)
        metrics = EngineMetrics(spec.name)
        engine = build_async_engine(
            spec.config, metrics, [client], None, served.max_waiting, served.log_interval, "least_loaded"
        )
        processor = engine.processor
        server = Server(
            engine,
            processor.tokenizer,
            spec.name,
            processor.limits.max_model_len,
            request_caps(served),
            served.prefix_cache_isolation,
        )
        server.reasoning_parser = served.reasoning_parser
        return ServedModel(server, create_app(server, front=front), metrics, client.pid)
    except BaseException:
        client.request_stop()
        client.join(5.0)
        raise


def forget_endpoints() -> None:
    """Let an unloaded model's app go. FastAPI caches, per endpoint function, whether it is a coroutine
    or generator function (LRU caches of 4096 entries in `fastapi.dependencies.models`, keyed by the
    function itself); an unloaded model's routes would stay in them, and through their closures its
    Server, AsyncEngine and tokenizer: tens of MB a load of a large vocabulary. Cleared after each unload
    (the loaded models' endpoints are classified again at their next request, in microseconds)."""
    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        clear = getattr(getattr(models, name, None), "cache_clear", None)
        if clear is not None:
            clear()
