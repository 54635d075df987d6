"""The engine: requests in, tokens and text out (tokenizer, detokenizer, scheduling loop).

What the server may build it with is exported here (`build_async_engine`, `local_cores`,
`front_end`: see `engine.build`), imported on first use so that importing a light module of the
package (the tokenizer, say) does not load the model's side.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_async_engine", "front_end", "local_cores"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tokenmill.engine import build

        return getattr(build, name)
    raise AttributeError(f"module 'tokenmill.engine' has no attribute {name!r}")
