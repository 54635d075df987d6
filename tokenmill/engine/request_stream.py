"""RequestStream: one accepted request's outputs, as the AsyncEngine hands them to its caller.

An async iterator over the request's RequestOutputs (deltas, cumulative or the final one) that ends
after the finished one, or raises what the engine put in its place (a refusal from the core, a
`RequestFailed`, the engine gone). Whatever ends it early aborts the request in the engine, so that
nothing runs once nobody waits for it: `close()` (or `aclose()`), the caller cancelled while it
waits, an error, or the stream dropped unclosed (its finalizer asks the event loop to abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenmill.outputs import RequestOutput


class RequestStream:
    def __init__(
        self,
        request_id: str,
        sink: asyncio.Queue[RequestOutput | BaseException],
        abort: Callable[[str], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """`abort(request_id)` is called on the event loop `loop` when the stream ends unfinished."""
        self.request_id = request_id
        self._sink = sink
        self._abort = abort
        self._loop = loop
        self.done = False  # finished, failed or closed: nothing more comes

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await self._sink.get()
        except BaseException:  # cancelled: the caller is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.done = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent; on the event loop)."""
        if not self.done:
            self.done = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        if not self.done and not self._loop.is_closed():  # dropped unclosed (a GC may run on any thread)
            self.done = True
            self._loop.call_soon_threadsafe(self._abort, self.request_id)
