"""Which requests may share prefix-cache entries: the server's cache isolation policy.

A prefix-cache hit shows in `usage.prompt_tokens_details.cached_tokens` (and in the time to the first
token), so a client that can hit another's entries can test whether a guessed prefix (another
tenant's system prompt, a document, a secret) was sent before. The policy decides the salt each
request's blocks are hashed with; entries are shared only between requests with the same salt:

- `none`: the request's own `cache_salt` only (vLLM's behaviour): without one, every client shares.
- `api-key` (the default): the API key that authenticated the request (a hash of it, set by the
  auth middleware as the request's tenant) salts its blocks beside its `cache_salt`, so clients with
  different keys never share entries. A server without keys has one tenant: everyone shares.
- `salt-required`: as `api-key`, and a request without `cache_salt` is refused (a gateway in front
  that serves many users with one key gives each its own salt).
"""

from __future__ import annotations

from tokenmill.server.validation import RequestError

ISOLATIONS = ("none", "api-key", "salt-required")


def cache_salt(isolation: str, tenant: str | None, salt: str | None) -> str | None:
    """The salt the engine hashes a request's prompt blocks with, under `isolation`, for a request
    from `tenant` (None: no API key in use) that sent `salt` (its `cache_salt`)."""
    if isolation == "salt-required" and not salt:
        raise RequestError(
            "This server shares prefix-cache entries only between requests with the same 'cache_salt': "
            "send one (--prefix-cache-isolation salt-required).",
            "cache_salt",
            "missing_required_parameter",
        )
    if isolation == "none" or tenant is None:
        return salt
    return f"tenant:{tenant}|salt:{salt or ''}"
