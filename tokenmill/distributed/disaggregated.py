"""DisaggregatedEngine: prefill on some engine cores, decode on others, the KV cache moved between.

The front end of `tokenmill serve --disaggregate prefill=P,decode=D`. A new request goes to a prefill
replica (least loaded) as a one-token request that keeps its prompt's KV (`kv_transfer.send`); when
it finishes there by length, its first token goes to the client as any token does, and the request
is handed to a decode replica (least loaded; all the children of an `n > 1` request to the same
one) with the tokens generated so far, its prompt's KV taken from the prefill replica
(`CoreClient.handoff`: actor to actor through Ray's object store, or directly in one process). The
decode replica admits it the way it admits a prefix-cache hit and continues from the first token.
A request that ends at its first token (EOS, a stop token, `max_tokens` 1) never moves.

Faults, on top of the AsyncEngine's: a decode replica that cannot fetch the KV (the prefill replica
died between) recomputes the prompt itself; a lost replica of either kind fails or restarts its
requests as any lost replica does (restarted on a prefill replica); with no decode replica running
(one lost, its replacement loading) a prefill replica decodes its own requests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tokenmill.engine.async_engine import AsyncEngine, EngineStopped, OpenRequest, Restart
from tokenmill.engine.core_client import CoreClient
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, KVTransferParams
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor

logger = logging.getLogger("tokenmill")


class DisaggregatedEngine(AsyncEngine):
    def __init__(
        self,
        prefill: Sequence[CoreClient],
        decode: Sequence[CoreClient],
        processor: OutputProcessor,
        metrics: EngineMetrics,
        max_waiting: int = 256,
        log_interval: float = 10.0,
        restart: Restart | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("disaggregate: expected at least one prefill and one decode engine")
        super().__init__([*prefill, *decode], processor, metrics, max_waiting, log_interval, restart=restart)
        self.num_prefill = len(prefill)
        self._prefill_ids = list(range(self.num_prefill))
        self._decode_ids = list(range(self.num_prefill, len(self.clients)))
        self.handoffs = 0  # requests moved from a prefill replica to a decode one
        self._prefilling: set[str] = set()  # core requests sent as prefills, not finished yet

    def _not_for_new_requests(self) -> list[int]:
        return self._decode_ids

    def _send(self, replica: int, requests: list[EngineCoreRequest], every_step: bool) -> bool:
        """Prefill only: one token, and the prompt's KV kept for a decode replica."""
        prefills = [_prefill_only(r) for r in requests]
        if not self.clients[replica].send_requests(prefills, every_step):
            return False
        self._prefilling.update(r.request_id for r in prefills if r.kv_transfer is not None)
        return True

    def _on_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        moving: list[tuple[str, list[int]]] = []
        if self._prefilling:
            for out in outputs.outputs:
                if out.request_id not in self._prefilling or (out.finish_reason is None and out.error is None):
                    continue
                self._prefilling.discard(out.request_id)
                if out.finish_reason == "length":  # its one token: not finished, it moves on
                    out.finish_reason, out.finished_time = None, None
                    moving.append((out.request_id, list(out.new_token_ids)))
        super()._on_outputs(replica, outputs)
        for core_id, tokens in moving:
            self._hand_off(replica, core_id, tokens)

    def _close(self, request_id: str) -> OpenRequest | None:
        entry = super()._close(request_id)
        if entry is not None and self._prefilling:
            self._prefilling.difference_update(r.request_id for r in entry.requests)
        return entry

    def _hand_off(self, source: int, core_id: str, tokens: list[int]) -> None:
        parent = self.processor.parent_of(core_id)
        entry = self._open.get(parent) if parent is not None else None
        original = next((r for r in entry.requests if r.request_id == core_id), None) if entry else None
        if parent is None or entry is None or original is None or not self.processor.running(core_id):
            # aborted, or ended here by a stop string its first token completed
            self.clients[source].drop_kv([core_id])
            return
        moved = dataclasses.replace(original, wait_for=None, kv_transfer=KVTransferParams(output_token_ids=tokens))
        target = entry.replica if entry.replica in self._decode_ids else None
        tried: list[int] = []
        while True:
            if target is None:
                target = self._decode_target(original, tried)
            if target is None:
                self._fail(parent, EngineStopped("no engine replica is running"))
                self.clients[source].drop_kv([core_id])
                return
            if self.clients[target].handoff(moved, entry.every_step, self.clients[source]):
                break
            tried.append(target)
            target = None
        if entry.replica != target:  # the request's first child to move: it is the decode replica's now
            self.router.load[entry.replica] = max(0, self.router.load[entry.replica] - 1)
            self.router.load[target] += 1
            entry.replica = target
        self.handoffs += 1

    def _decode_target(self, request: EngineCoreRequest, tried: list[int]) -> int | None:
        """The least loaded decode replica; with none running, a prefill one (it decodes too, more
        slowly than a dedicated one, rather than fail the request)."""
        for others in (self._prefill_ids, self._decode_ids):
            try:
                return self.router.pick(request.prompt_token_ids, request.cache_salt, [*others, *tried]).replica
            except LookupError:
                continue
        return None

    def _fail(self, request_id: str, error: BaseException) -> None:
        entry = self._close(request_id)
        if entry is not None:
            self.processor.abort_request(request_id)
            entry.sink.put_nowait(error)


def _prefill_only(request: EngineCoreRequest) -> EngineCoreRequest:
    if request.max_tokens <= 1:
        return request
    return dataclasses.replace(request, max_tokens=1, kv_transfer=KVTransferParams(send=True))
