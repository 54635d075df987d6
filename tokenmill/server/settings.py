"""`tokenmill serve`'s own settings (`ServeSettings`: its flags and keys of its --config, the engine's being
EngineConfig's) and the start of a server from them: request caps, the front door, connection limits and
the replicas' placement."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig, check_settings, setting
from tokenmill.distributed.config import ROUTING
from tokenmill.server.front_door import (
    API_KEY_ENV_VAR,
    AUTO_CONNECTIONS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    ConnectionLimits,
    FrontDoor,
    parse_api_keys,
)
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tenancy import ISOLATIONS
from tokenmill.server.trace_recorder import PRIVACY, TraceRecorder

if TYPE_CHECKING:
    from tokenmill.server.protocol import RequestCaps
    from tokenmill.server.serving import Server


@dataclass(frozen=True)
class ServeSettings:
    """`tokenmill serve`'s own settings (the engine's are EngineConfig's): its flags, and keys of its --config."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port (0: any free port, logged at start)", minimum=0)
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health; several keys "
        "comma-separated or by repeating the flag (default: $TOKENMILL_API_KEY, else none). A key on the command "
        "line shows in ps: prefer the variable or --config",
    )
    metrics_public: bool = setting(False, "serve /metrics without the API key (for a scraper on a private network)")
    served_model_name: str | None = setting(
        None, "the model name clients send (default: the model folder's name, or the GGUF file's without .gguf)"
    )
    max_waiting: int = setting(
        64,
        "refuse a request (429) whose sequences (prompts x n) would take those waiting past this many "
        "(one that finds none waiting always goes in)",
        minimum=1,
    )
    max_n: int = setting(16, "largest n a request may ask for", minimum=1)
    max_tokens_limit: int | None = setting(
        None, "largest max_tokens a request may ask for (default: no cap)", minimum=1
    )
    max_prompt_tokens: int | None = setting(
        None, "longest prompt accepted, in tokens (default: only the model's length limits it)", minimum=1
    )
    # caps on one request (a 400 naming the field past them; /openapi.json states them): well above what
    # OpenAI or vLLM clients send, low enough that no request costs everyone else much
    max_stop: int = setting(16, "most stop strings in a request (OpenAI allows 4)", minimum=1)
    max_prompts: int = setting(64, "most prompts in one completions request", minimum=1)
    max_choices: int = setting(128, "most sequences one request starts: n x its prompts", minimum=1)
    max_pooling_inputs: int = setting(
        2048, "most inputs of one embeddings request, documents of one rerank, texts a side of one score", minimum=1
    )
    max_stop_token_ids: int = setting(1024, "most stop_token_ids in a request", minimum=1)
    max_allowed_token_ids: int = setting(16384, "most allowed_token_ids in a request", minimum=1)
    max_logit_bias: int = setting(1024, "most logit_bias entries in a request (OpenAI allows 300)", minimum=1)
    max_bad_words: int = setting(1024, "most bad_words in a request", minimum=1)
    max_bad_words_chars: int = setting(32768, "most characters in all of a request's bad_words", minimum=1)
    max_tools: int = setting(128, "most tools in a chat request (as OpenAI)", minimum=1)
    max_tools_chars: int = setting(262144, "most characters in all of a request's tools, as JSON", minimum=1)
    max_schema_chars: int = setting(
        131072,
        "longest structured-output spec (guided_json / _regex / _grammar / _choice, structured_outputs, "
        "response_format's schema) or tool parameters, in characters of its JSON text",
        minimum=1,
    )
    max_schema_depth: int = setting(
        64, "deepest nesting of a JSON schema in a request (guided_json, response_format, tool parameters)", minimum=1
    )
    strict_fields: bool = setting(
        False, "refuse (400) request fields the server does not know, instead of ignoring them as vLLM does"
    )
    drain_timeout: float = setting(30.0, "seconds in-flight requests get on SIGTERM")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "largest request body accepted (413 past it)", minimum=1)
    max_json_depth: int = setting(
        DEFAULT_MAX_JSON_DEPTH, "deepest nesting of arrays and objects a request body may have (400 past it)", minimum=1
    )
    header_timeout: float = setting(
        10.0, "seconds a client has to send a request's line and headers (then a 408 and the connection closed)"
    )
    body_timeout: float = setting(60.0, "seconds a client has to send a request's body, after its headers")
    keep_alive_timeout: float = setting(5.0, "seconds an idle keep-alive connection stays open between requests")
    max_connections: int | None = setting(
        None,
        "most open client connections; past it the oldest idle one is closed, else the new one gets a 503 "
        f"(default: {AUTO_CONNECTIONS}, or twice max_num_seqs + max_waiting if more; always below the open-file "
        "limit, which is raised to its hard limit at start)",
        minimum=1,
    )
    prefix_cache_isolation: str = setting(
        "api-key",
        "which requests share prefix-cache entries (and see each other's cached_tokens): none (only "
        "cache_salt separates them), api-key (each API key its own entries), salt-required (as api-key, "
        "and a request without cache_salt is refused)",
        choices=ISOLATIONS,
    )
    data_parallel_size: int = setting(
        1, "engine replicas, each a Ray actor with its own model copy, KV cache and share of the CPU threads", minimum=1
    )
    routing: str = setting(
        "least_loaded",
        "where a request goes among the replicas: the least loaded, or (prefix) the one holding the longest "
        "cached prefix of its prompt, by load when that prefix is short",
        choices=ROUTING,
    )
    disaggregate: str | None = setting(
        None,
        "prefill=P,decode=D: P engine replicas compute prompts, D others decode, the KV cache moved between "
        "them on Ray (instead of --data-parallel-size)",
    )
    ray_address: str | None = setting(
        None, "run the replicas on this existing Ray cluster (auto, host:port, ray://host:10001); default: a local one"
    )
    log_interval: float = setting(10.0, "seconds between throughput log lines")
    reasoning_parser: str | None = setting(
        None,
        "split a chat answer's <think>...</think> part into reasoning_content (qwen3: when the answer opens "
        "<think>; deepseek_r1: the answer starts inside it); default: none, all is content",
        choices=REASONING_PARSERS,
    )
    record_trace: str | None = setting(
        None,
        "append a JSON line per finished request to this file (arrival, prompt and output lengths, finish reason, "
        "TTFT, TPOT, the prompt as block hashes or token ids), for tokenmill doctor --workload trace:FILE",
    )
    record_trace_privacy: str = setting(
        "hashes",
        "what the recorded trace keeps of a prompt: hashes (chained hashes of its 16-token blocks, keyed by a "
        "random salt held in memory only: prefix sharing without the text) or tokens (its token ids)",
        choices=PRIVACY,
    )
    record_trace_max_bytes: int = setting(
        256 << 20, "size past which the recorded trace moves to FILE.1, FILE.2, ... and starts anew", minimum=1
    )
    # several models on one server, loaded on demand (server/multi_app.py, server/model_pool.py)
    models: str | None = setting(
        None,
        "serve several models (instead of MODEL): a YAML or JSON file mapping each name clients send to a model "
        "path, or to a mapping of its path and settings (any engine setting, and its own served caps); "
        "see docs/several-models.md",
    )
    models_dir: str | None = setting(
        None, "serve every model folder and .gguf file in this folder, each named after it (instead of MODEL)"
    )
    memory: str | None = setting(
        None,
        "with --models / --models-dir: keep the loaded models' weights + KV caches under this size (bytes, or as "
        "24GiB), unloading the least recently used idle ones first (default: no limit)",
    )
    idle_unload: float | None = setting(
        None, "with --models / --models-dir: unload a model no request has used for this many seconds"
    )
    load_wait: float = setting(
        60.0,
        "with --models / --models-dir: seconds a request waits for its model to load (or for memory to load it "
        "in) before a 503 with Retry-After; the load goes on",
    )

    def __post_init__(self) -> None:
        check_settings(self)


class JoinedAction(argparse.Action):
    """A repeatable flag: its values joined with commas (`--api-key A --api-key B` gives 'A,B')."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


CAPS = (  # ServeSettings fields that are `RequestCaps` fields of the same name
    "max_stop",
    "max_prompts",
    "max_choices",
    "max_pooling_inputs",
    "max_stop_token_ids",
    "max_allowed_token_ids",
    "max_logit_bias",
    "max_bad_words",
    "max_bad_words_chars",
    "max_tools",
    "max_tools_chars",
    "max_schema_chars",
    "max_schema_depth",
)


def request_caps(settings: ServeSettings) -> RequestCaps:
    """The caps on one request that `settings` give."""
    from tokenmill.server.protocol import RequestCaps

    return RequestCaps(
        max_n=settings.max_n,
        max_tokens=settings.max_tokens_limit,
        max_prompt_tokens=settings.max_prompt_tokens,
        **{name: getattr(settings, name) for name in CAPS},
        strict_fields=settings.strict_fields,
    )


def run_server(config: EngineConfig, settings: ServeSettings, key_on_command_line: bool) -> None:
    """Build the server `settings` describe around an engine for `config` and serve until stopped."""
    from tokenmill.runner.startup_log import phase

    with phase("loading the engine's and the server's code (torch, uvicorn)"):  # (seconds, before any model line)
        from tokenmill.distributed.config import ParallelConfig
        from tokenmill.server.launch import build_server, serve

    limits = request_caps(settings)
    if key_on_command_line:
        logging.getLogger("tokenmill").warning(
            "--api-key on the command line shows in ps; set %s or put api_key in --config instead", API_KEY_ENV_VAR
        )
    front = FrontDoor(
        api_keys=parse_api_keys([settings.api_key or os.environ.get(API_KEY_ENV_VAR)]),
        metrics_public=settings.metrics_public,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
    )
    connections = ConnectionLimits(
        settings.header_timeout, settings.body_timeout, settings.keep_alive_timeout, settings.max_connections
    )
    if settings.models is not None or settings.models_dir is not None:  # several models (server/multi_app.py)
        from tokenmill.server.multi_app import run_several

        run_several(config, settings, front, connections)
        return
    if settings.disaggregate is not None:
        if settings.data_parallel_size > 1:
            raise ValueError("data_parallel_size: not with disaggregate (give the replicas as prefill=P,decode=D)")
        parallel = ParallelConfig.disaggregate(settings.disaggregate, settings.ray_address)
    else:
        parallel = ParallelConfig(settings.data_parallel_size, settings.routing, settings.ray_address)
    server = build_server(
        config,
        settings.served_model_name,
        settings.max_waiting,
        limits,
        settings.log_interval,
        parallel,
        settings.prefix_cache_isolation,
    )
    server.reasoning_parser = settings.reasoning_parser
    busiest = config.max_num_seqs * settings.data_parallel_size + settings.max_waiting
    recorder = None
    if settings.record_trace is not None:
        recorder = record_trace(
            server, settings.record_trace, settings.record_trace_privacy, settings.record_trace_max_bytes
        )
    try:
        serve(server, settings.host, settings.port, None, settings.drain_timeout, front, connections, busiest)
    finally:
        if recorder is not None:
            recorder.close()


def record_trace(server: Server, path: str, privacy: str, max_bytes: int) -> TraceRecorder:
    """Record `server`'s finished requests to `path` (server/trace_recorder.py) until the recorder is closed."""
    recorder = TraceRecorder(path, privacy, max_bytes, server.model_name)
    server.engine.on_finished = recorder.record
    logging.getLogger("tokenmill").info(
        "recording finished requests to %s (prompts as %s; a new part past %d bytes)", path, privacy, max_bytes
    )
    return recorder
