"""Placement: where the AsyncEngine's requests run, and where they go on from there.

The AsyncEngine routes a new request to a replica (its router: least loaded, or prefix-aware) and asks
its placement, on the way: which replicas a new request never starts on (`excluded`), what the core
requests sent to a replica are (`outgoing`: a placement may send part of the work, a prefill), and,
around each batch of a replica's outputs (`before_outputs`, `after_outputs`), whether a request moves
on to another replica. `closed` tells it a request is done (finished, failed or aborted).

`Direct`, the default, runs every request whole where the router sends it. Prefill/decode
disaggregation (`tokenmill.distributed.disaggregated.Disaggregation`) is a placement of its own,
composed with the engine through this interface and the engine's public methods (`open_request`,
`fail_request`, `move`), not a subclass of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncEngine


class Placement(Protocol):
    def bind(self, engine: AsyncEngine) -> None:
        """The engine it places requests for (once, when the engine is built)."""
        ...

    def excluded(self) -> Sequence[int]:
        """Replicas a new request never starts on."""
        ...

    def outgoing(self, replica: int, requests: list[EngineCoreRequest]) -> list[EngineCoreRequest]:
        """The core requests of one request, as they are sent to `replica`."""
        ...

    def before_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """A batch of `replica`'s outputs, before the output processor sees them (a request that moves
        on has its finish taken back here)."""
        ...

    def after_outputs(self, replica: int) -> None:
        """The same batch, processed: requests that move on go to their next replica now."""
        ...

    def closed(self, requests: list[EngineCoreRequest]) -> None:
        """A request's core requests are done (finished, failed or aborted)."""
        ...


class Direct:
    """Every request runs whole on the replica the router picks."""

    def bind(self, engine: AsyncEngine) -> None:
        pass

    def excluded(self) -> Sequence[int]:
        return ()

    def outgoing(self, replica: int, requests: list[EngineCoreRequest]) -> list[EngineCoreRequest]:
        return requests

    def before_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        pass

    def after_outputs(self, replica: int) -> None:
        pass

    def closed(self, requests: list[EngineCoreRequest]) -> None:
        pass
