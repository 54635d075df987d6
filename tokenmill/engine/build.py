"""Assembling a served engine from its parts: the cores' clients, the front end, the AsyncEngine.

The server reaches the engine only through this, `async_engine`, `request_stream`, the tokenizer and
the metrics: it never builds a core or a client itself. `local_cores` starts one core on an engine
thread of this process (built on the thread that will step it, see `engine_thread`) with the
watchdog's in-place restart; `front_end` builds the output processor over any clients (local, or
replicas started by `tokenmill.distributed`), sharing its grammar compiler with a core in this
process so that each spec compiles once; `build_async_engine` puts them together. Thin on purpose:
each step calls the constructors as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core import EngineCore
from tokenmill.engine.core_client import CoreClient, LocalCoreClient, Restart, restart_in_place
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.pooling import PoolingFrontEnd
from tokenmill.engine.pooling_config import read_pooling_config
from tokenmill.runner.startup_log import phase
from tokenmill.text.tokenizer import Tokenizer


def local_cores(config: EngineConfig) -> tuple[list[CoreClient], Restart]:
    """One core on an engine thread of this process (loaded now): its client, and its restart."""
    thread = EngineThread()  # the core is built on the thread that will step it (see engine_thread)
    core = thread.run(lambda: EngineCore(config))
    return [LocalCoreClient(core, thread)], restart_in_place([core], [thread])


def front_end(
    config: EngineConfig, clients: Sequence[CoreClient], tokenizer: Tokenizer | None = None
) -> OutputProcessor:
    """The output processor for these cores (sized by the first; `tokenizer`: loaded already, else
    now); a core in this process shares its grammar compiler."""
    tokenizer = tokenizer or Tokenizer(config.model)
    pooling = PoolingFrontEnd(read_pooling_config(config), tokenizer)
    processor = OutputProcessor(tokenizer, clients[0].limits, config.seed, config.grammar_compile_timeout, pooling)
    for client in clients:
        if isinstance(client, LocalCoreClient) and client.core.worker.runner.batch.grammar is not None:
            client.core.worker.runner.batch.grammar.use_compiler(processor.grammar)
    return processor


def build_async_engine(
    config: EngineConfig,
    metrics: EngineMetrics,
    clients: Sequence[CoreClient] | None = None,
    restart: Restart | None = None,
    max_waiting: int = 256,
    log_interval: float = 10.0,
    routing: str = "least_loaded",
) -> AsyncEngine:
    """The AsyncEngine over `clients` (None: one local core, see `local_cores`; the tokenizer loads on a
    second thread meanwhile, where this one would only wait for the core's start-up)."""
    tokenizer = None
    if clients is None:
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            loading = pool.submit(Tokenizer, config.model)
            clients, restart = local_cores(config)
            if not loading.done():  # (said only where the start waits for it)
                with phase("loading the tokenizer (begun on a second thread beside the model)"):
                    loading.result()
            tokenizer = loading.result()
    processor = front_end(config, clients, tokenizer)
    return AsyncEngine(clients, processor, metrics, max_waiting, log_interval, routing, restart)
