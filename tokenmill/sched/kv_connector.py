"""The edges through which a request's KV cache moves between engines (prefill/decode disaggregation).

Pure Python, as the rest of `sched`. The engine core hands one connector object to both the scheduler
and the worker and never calls it itself; a core that serves requests whole gets `NoKVConnector`.
A `KVConnector` is the scheduler's edge, through which KV that was computed elsewhere enters the
scheduler, and through which a finished prefill's KV leaves it:

- `external_tokens(request, num_hit)`: at admission, after the local prefix-cache hit of `num_hit`
  tokens, how many more of the request's tokens an external source holds (its prompt's KV, sent by
  a prefill engine). The request is then admitted the way a prefix-cache hit is: those tokens count
  as computed, and only what follows them runs.
- `allocated(request, block_ids, num_hit, num_external)`: the blocks now allocated for it: where the
  external tokens [num_hit, num_hit + num_external) go. The connector turns this into a `KVLoad`
  for the worker, which writes them before the step's forward.
- `finished(request, block_ids)`: a request finishes, its blocks about to be freed. A prefill whose
  KV is to be sent records a `KVSave`; the worker copies the blocks out in the same step, before
  anything can write into the freed blocks again (nothing does between a step's update and the next
  step's forward).

A `KVWorkerConnector` is the worker's edge, bound to the engine's KV cache (`bind`): `before_forward`
writes the received KV of the requests admitted this step, `after_update` copies out the KV of the
prefills that finished in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.request import Request


@dataclass(frozen=True)
class KVLoad:
    """Write the received blocks [first_block, first_block + len(block_ids)) of a request's KV into
    these blocks of the cache."""

    request_id: str
    block_ids: list[int]
    first_block: int


@dataclass(frozen=True)
class KVSave:
    """Copy out the KV of a finished prefill: its `num_tokens` tokens in these blocks (in order)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


class KVConnector(Protocol):
    def external_tokens(self, request: Request, num_hit: int) -> int:
        """Tokens past the first `num_hit` whose KV an external source holds for this request."""
        ...

    def allocated(self, request: Request, block_ids: list[int], num_hit: int, num_external: int) -> None:
        """The request's blocks after its admission (the external tokens' among them)."""
        ...

    def finished(self, request: Request, block_ids: list[int]) -> None:
        """The request has finished; these were its blocks (freed right after this call)."""
        ...


class KVWorkerConnector(Protocol):
    """The worker's side, bound to the engine's KV cache: what the scheduler side queued."""

    def bind(self, kv_caches: Sequence[object]) -> None:
        """The engine's KV cache (one entry a layer, in the attention backend's layout)."""
        ...

    def before_forward(self) -> None:
        """Write the received KV of the requests admitted this step (before the forward)."""
        ...

    def after_update(self) -> None:
        """Copy out the KV of the prefills that finished this step (before the next step)."""
        ...

    def stats_fields(self) -> dict[str, float]:
        """Its counters, as `EngineStats` fields."""
        ...


class KVTransfer(KVConnector, KVWorkerConnector, Protocol):
    """Both edges in one object, as an engine core takes it."""


class NoKVConnector:
    """A core that serves requests whole: nothing comes in from elsewhere, nothing goes out."""

    def external_tokens(self, request: Request, num_hit: int) -> int:
        return 0

    def allocated(self, request: Request, block_ids: list[int], num_hit: int, num_external: int) -> None:
        pass

    def finished(self, request: Request, block_ids: list[int]) -> None:
        pass

    def bind(self, kv_caches: Sequence[object]) -> None:
        pass

    def before_forward(self) -> None:
        pass

    def after_update(self) -> None:
        pass

    def stats_fields(self) -> dict[str, float]:
        return {}
