"""The API-key check: with keys configured, every request but `/health` (and `/metrics` when it is
public) must carry one, as `Authorization: Bearer <key>` (the scheme in any case) or `x-api-key: <key>`;
else a 401 in OpenAI's shape.

Keys are compared in constant time: the sent key's SHA-256 against each configured key's, every key
compared (no early exit), so neither the time to refuse nor to accept tells how much of a key was
right or which key matched. A request that passes gets `request.state.tenant`, a short hash of its
key, which the prefix-cache isolation policy (tenancy.py) keys on; the key itself is not kept there.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.middleware import send_error
from tokenmill.server.validation import RequestError

ALWAYS_PUBLIC = frozenset({"/health"})


def tenant_id(key: str) -> str:
    """Who a key's requests belong to: 16 hex digits of its SHA-256 (the key cannot be read back)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def sent_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request sent: `Authorization: Bearer <key>` (scheme case-insensitive), else `x-api-key`."""
    auth = api_key = None
    for name, value in headers:
        if name == b"authorization":
            auth = value
        elif name == b"x-api-key":
            api_key = value.strip()
    if auth is not None:
        scheme, _, token = auth.strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
    return api_key or None


def unauthorized() -> RequestError:
    return RequestError(
        "Missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>').",
        None,
        "invalid_api_key",
        401,
        "authentication_error",
    )


class ApiKeyCheck:
    """The check above, as a plain ASGI middleware (it leaves `receive` alone, so a handler still hears
    its client disconnect). Nothing is checked without keys."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], metrics_public: bool = False) -> None:
        self.app = app
        self.keys = [(hashlib.sha256(k.encode()).digest(), tenant_id(k)) for k in keys]
        self.public = ALWAYS_PUBLIC | ({"/metrics"} if metrics_public else set())

    def match(self, key: bytes | None) -> str | None:
        """The tenant of the configured key equal to `key`, or None."""
        digest = hashlib.sha256(key or b"").digest()
        found = None
        for expected, tenant in self.keys:  # all compared: the time does not depend on which matched
            if hmac.compare_digest(digest, expected) and key is not None:
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        tenant = self.match(sent_key(scope["headers"]))
        if tenant is None:
            await send_error(send, unauthorized(), [(b"www-authenticate", b"Bearer")])
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
