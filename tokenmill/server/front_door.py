"""The server's front-door settings, as plain dataclasses (no web framework imported, so the command
line reads them cheaply): what the app checks before a handler runs (`FrontDoor`: API keys, body size,
JSON depth; middleware.py, auth.py, json_body.py enforce it) and what the protocol layer enforces on
connections (`ConnectionLimits`: deadlines and the connection cap; connections.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

API_KEY_ENV_VAR = "TOKENMILL_API_KEY"
DEFAULT_MAX_BODY_BYTES = 32 << 20  # a 20 MB prompt passes; a 300 MB one is refused before it is read
DEFAULT_MAX_JSON_DEPTH = 128  # a JSON schema of ~60 nested objects; a chat request needs ~6
AUTO_CONNECTIONS = 1024  # the automatic connection cap, when the engine's capacity asks for less


@dataclass(frozen=True)
class FrontDoor:
    """What the app checks before a handler runs: the API keys (none: no check), whether /metrics is
    open without one, the largest body and the deepest JSON a request may send."""

    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines (seconds) for a client to send a request's headers and its body, the keep-alive
    timeout between requests, and the cap on open connections (None: automatic, see
    connections.connection_cap)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections: expected a positive integer, got {self.max_connections}")


def parse_api_keys(values: Iterable[str | None]) -> tuple[str, ...]:
    """The keys in `values`, each a key or several separated by commas; blanks dropped, order kept."""
    keys: list[str] = []
    for value in values:
        for key in (value or "").split(","):
            key = key.strip()
            if key and key not in keys:
                keys.append(key)
    return tuple(keys)
