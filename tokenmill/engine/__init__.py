"""The engine: requests in, tokens and text out (tokenizer, detokenizer, scheduling loop).

What the server may use besides `async_engine`, `request_stream`, `tokenizer` and `metrics` is
exported here: `build_async_engine`, `local_cores` and `front_end` (see `engine.build`), and the
front door's `CheckedRequest` (see `engine.request_checks`), and the pooling front end's
`PoolingFrontEnd` and `UnsupportedTask` (see `engine.pooling`), and `spawn_core` and `CoreLoadFailed`
(a core in a child process of its own, see `engine.process_client`). Each is imported on first use, so that
importing a light module of the package (the tokenizer, say) does not load the model's side.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "build_async_engine": "build",
    "front_end": "build",
    "local_cores": "build",
    "CheckedRequest": "request_checks",
    "PoolingFrontEnd": "pooling",
    "UnsupportedTask": "pooling",
    "spawn_core": "process_client",
    "CoreLoadFailed": "process_client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"tokenmill.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tokenmill.engine' has no attribute {name!r}")
