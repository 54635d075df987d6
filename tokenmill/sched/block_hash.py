"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent block's hash, its token ids, and extra keys for anything else
that changes its KV (at least the request's `cache_salt`, so tenants cannot probe each other's
cache). SHA-256 makes a collision, and so a hit on the wrong KV, practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b"tokenmill-prefix-root"


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra: str | None) -> bytes:
    """The hash of one full block, chained on its parent's (None for the first block)."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\x00salt\x00" + extra.encode("utf-8"))
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra: str | None, parent: bytes | None = None
) -> list[bytes]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
