"""TransferConnector: one engine core's KV transfer, both halves (prefill/decode disaggregation).

The engine core hands it to its scheduler and its worker (`sched.kv_connector.KVTransfer`) and never
calls it itself. The scheduler's half: a request with `send_kv` (a prefill, sent with
`kv_transfer.send`) has the KV of its prompt copied out when it finishes by length after its first
token; a request whose KV was `put` here (a decode) is admitted with that KV counted as computed, past
any prefix of it this engine has cached itself. The worker's half, bound to the engine's cache:
`before_forward` writes received blocks before the step's forward, `after_update` copies a finished
prefill's blocks out after the step's update.

Between engines the copies travel as `runner.kv_blocks.KVBlocks` (one uint8 array and its layout):
`take` hands a saved copy over once (the decode engine's side calls it through Ray, or directly in
one process); a copy nobody takes is dropped after `OUTBOX_TTL_S`. Counters (bytes, copies, time,
requests that had to recompute their prompt because their KV did not arrive) go to the engine's stats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from tokenmill.layers.attention import KVCache
from tokenmill.request import Request, RequestStatus
from tokenmill.runner.kv_blocks import KVBlocks, check, read_blocks, write_blocks
from tokenmill.sched.kv_connector import KVLoad, KVSave

logger = logging.getLogger("tokenmill")

OUTBOX_TTL_S = 120.0  # a saved prefill nobody came for (its client went away) is dropped after this


@dataclass
class TransferCounters:
    sent_bytes: int = 0
    received_bytes: int = 0
    sent: int = 0  # prefills whose KV was copied out
    received: int = 0  # requests admitted with received KV
    recomputed: int = 0  # handed-over requests whose KV did not arrive: their prompt was recomputed here
    seconds: float = 0.0  # copying KV out of and into the cache, and fetching it from the other engine


class TransferConnector:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.caches: list[KVCache] = []  # bound by the engine once its cache exists
        self._lock = threading.Lock()  # inbox and outbox: the core's thread and the transfer's
        self._inbox: dict[str, KVBlocks] = {}
        self._outbox: dict[str, tuple[float, KVBlocks]] = {}
        self._loads: list[KVLoad] = []
        self._saves: list[KVSave] = []
        self.counters = TransferCounters()

    def stats_fields(self) -> dict[str, float]:
        """The counters as EngineStats' kv_transfer_* fields."""
        c = self.counters
        return {
            "kv_transfer_sent_bytes": c.sent_bytes,
            "kv_transfer_received_bytes": c.received_bytes,
            "kv_transfer_sent": c.sent,
            "kv_transfer_received": c.received,
            "kv_transfer_recomputed": c.recomputed,
            "kv_transfer_seconds": c.seconds,
        }

    def bind(self, kv_caches: Sequence[object]) -> None:
        self.caches = cast(list[KVCache], list(kv_caches))

    def add_seconds(self, seconds: float) -> None:
        """Time a transfer took outside this connector (fetching a handoff's KV)."""
        with self._lock:
            self.counters.seconds += seconds

    # -- the scheduler's half --------------------------------------------------------------------

    def external_tokens(self, request: Request, num_hit: int) -> int:
        with self._lock:
            blocks = self._inbox.get(request.request_id)
        if blocks is None:
            return 0
        # the received prompt's KV, short of the last token to run (at least one is computed here)
        return max(0, min(blocks.num_tokens, request.num_tokens - 1) - num_hit)

    def allocated(self, request: Request, block_ids: list[int], num_hit: int, num_external: int) -> None:
        first = num_hit // self.block_size
        last = -(-(num_hit + num_external) // self.block_size)
        self._loads.append(KVLoad(request.request_id, block_ids[first:last], first))

    def finished(self, request: Request, block_ids: list[int]) -> None:
        request_id = request.request_id
        with self._lock:
            self._inbox.pop(request_id, None)  # finished (aborted) before its KV was loaded
        if not request.send_kv:
            return
        prompt = request.num_prompt_tokens
        if request.status is RequestStatus.FINISHED_LENGTH and request.num_computed_tokens >= prompt:
            self._saves.append(KVSave(request_id, block_ids[: -(-prompt // self.block_size)], prompt))

    # -- the worker's half -----------------------------------------------------------------------

    def before_forward(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            start = time.perf_counter()
            with self._lock:
                blocks = self._inbox.pop(load.request_id, None)
            if blocks is None:  # (its request was aborted in between: it does not run)
                continue
            write_blocks(self.caches, blocks, load.first_block, load.block_ids)
            self.counters.received += 1
            self.counters.received_bytes += blocks.nbytes
            self.counters.seconds += time.perf_counter() - start

    def after_update(self) -> None:
        saves, self._saves = self._saves, []
        now = time.monotonic()
        for save in saves:
            start = time.perf_counter()
            blocks = read_blocks(self.caches, save.block_ids, save.num_tokens)
            with self._lock:
                self._outbox[save.request_id] = (now, blocks)
            self.counters.sent += 1
            self.counters.sent_bytes += blocks.nbytes
            self.counters.seconds += time.perf_counter() - start
        if saves:
            self._expire(now)

    # -- between engines -------------------------------------------------------------------------

    def take(self, request_id: str) -> KVBlocks | None:
        """A finished prefill's KV, handed over once (None: not here, or already taken or dropped)."""
        with self._lock:
            entry = self._outbox.pop(request_id, None)
        return entry[1] if entry is not None else None

    def drop(self, request_ids: list[str]) -> None:
        """Forget saved copies nobody will take (their requests were aborted)."""
        with self._lock:
            for request_id in request_ids:
                self._outbox.pop(request_id, None)

    def put(self, request_id: str, blocks: KVBlocks | None) -> None:
        """KV received for a request about to be added; None (it did not arrive) or KV this engine
        cannot use: the request recomputes its prompt here."""
        why = check(self.caches, blocks) if blocks is not None else "it did not arrive"
        if why is not None:
            logger.warning("request %s recomputes its prompt: its KV %s", request_id, why)
            self.counters.recomputed += 1
            return
        assert blocks is not None
        with self._lock:
            self._inbox[request_id] = blocks

    def _expire(self, now: float) -> None:
        with self._lock:
            old = [r for r, (t, _) in self._outbox.items() if now - t > OUTBOX_TTL_S]
            for request_id in old:
                del self._outbox[request_id]
