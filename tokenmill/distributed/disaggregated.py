"""Prefill/decode disaggregation: prefill on some engine cores, decode on others, the KV cache moved between.

The front end of `tokenmill serve --disaggregate prefill=P,decode=D`, composed from parts:
`Disaggregation` is the AsyncEngine's placement (`engine/placement.py`): a new request goes to a
prefill replica (least loaded) as a one-token request that keeps its prompt's KV (`kv_transfer.send`);
when it finishes there by length, its first token goes to the client as any token does, and the KV
mover (`_hand_off`) hands the request to a decode replica (least loaded; all the children of an
`n > 1` request to the same one) with the tokens generated so far, its prompt's KV taken from the
prefill replica by the decode replica's `TransferClient.handoff` (actor to actor through Ray's object
store for `RayCoreClient`, or connector to connector in one process for `LocalTransferClient`). The
decode replica admits it the way it admits a prefix-cache hit and continues from the first token.
A request that ends at its first token (EOS, a stop token, `max_tokens` 1) never moves.
`disaggregated_engine` puts the AsyncEngine, the placement and the clients together.

Faults, on top of the AsyncEngine's: a decode replica that cannot fetch the KV (the prefill replica
died between) recomputes the prompt itself; a lost replica of either kind fails or restarts its
requests as any lost replica does (restarted on a prefill replica); with no decode replica running
(one lost, its replacement loading) a prefill replica decodes its own requests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.distributed.kv_transfer import TransferConnector
from tokenmill.engine.async_engine import AsyncEngine, EngineStopped
from tokenmill.engine.core import EngineCore
from tokenmill.engine.core_client import CoreClient, LocalCoreClient, Restart
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, KVTransferParams
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor

logger = logging.getLogger("tokenmill")


class TransferClient(CoreClient, Protocol):
    """A core client whose core takes part in KV transfer (built with a `TransferConnector`)."""

    def handoff(self, request: EngineCoreRequest, every_step: bool, source: TransferClient) -> bool:
        """Queue a request whose prompt `source` (a prefill engine) has computed, with that prompt's KV
        taken from there; False if this core has ended."""
        ...

    def drop_kv(self, request_ids: list[str]) -> None:
        """Forget the saved KV of these finished prefills (nobody will take it)."""
        ...


class LocalTransferClient(LocalCoreClient):
    """A core on a thread of this process with its TransferConnector: KV moves connector to connector."""

    def __init__(self, core: EngineCore, thread: EngineThread, transfer: TransferConnector) -> None:
        super().__init__(core, thread)
        self.transfer = transfer

    def handoff(self, request: EngineCoreRequest, every_step: bool, source: TransferClient) -> bool:
        assert isinstance(source, LocalTransferClient), "a local prefill core"
        self.transfer.put(request.request_id, source.transfer.take(request.request_id))
        return self.send_requests([request], every_step)

    def drop_kv(self, request_ids: list[str]) -> None:
        self.transfer.drop(request_ids)


def local_transfer_client(config: EngineConfig) -> LocalTransferClient:
    """A core with a TransferConnector, built on the engine thread that will step it."""
    thread = EngineThread()
    transfer = TransferConnector(config.block_size)
    return LocalTransferClient(thread.run(lambda: EngineCore(config, transfer)), thread, transfer)


class Disaggregation:
    """The placement: new requests prefill on replicas [0, num_prefill), then move to the rest."""

    def __init__(self, num_prefill: int, num_decode: int) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("disaggregate: expected at least one prefill and one decode engine")
        self.prefill_ids = list(range(num_prefill))
        self.decode_ids = list(range(num_prefill, num_prefill + num_decode))
        self.handoffs = 0  # requests moved from a prefill replica to a decode one
        self._prefilling: set[str] = set()  # core requests sent as prefills, not finished yet
        self._moving: list[tuple[str, list[int]]] = []  # (core request, its tokens) of the outputs at hand
        self._engine: AsyncEngine | None = None

    def bind(self, engine: AsyncEngine) -> None:
        if len(engine.clients) != len(self.prefill_ids) + len(self.decode_ids):
            raise ValueError("disaggregate: the engine's replicas are not the prefill and decode ones")
        self._engine = engine

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None, "bind() first"
        return self._engine

    def excluded(self) -> Sequence[int]:
        return self.decode_ids

    def outgoing(self, replica: int, requests: list[EngineCoreRequest]) -> list[EngineCoreRequest]:
        """Prefill only: one token, and the prompt's KV kept for a decode replica."""
        prefills = [_prefill_only(r) for r in requests]
        self._prefilling.update(r.request_id for r in prefills if r.kv_transfer is not None)
        return prefills

    def before_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """A prefill finished by length (its one token) is not finished: it moves on."""
        if not self._prefilling:
            return
        for out in outputs.outputs:
            if out.request_id not in self._prefilling or (out.finish_reason is None and out.error is None):
                continue
            self._prefilling.discard(out.request_id)
            if out.finish_reason == "length":
                out.finish_reason, out.finished_time = None, None
                self._moving.append((out.request_id, list(out.new_token_ids)))

    def after_outputs(self, replica: int) -> None:
        moving, self._moving = self._moving, []
        for core_id, tokens in moving:
            self._hand_off(replica, core_id, tokens)

    def closed(self, requests: list[EngineCoreRequest]) -> None:
        if self._prefilling:
            self._prefilling.difference_update(r.request_id for r in requests)

    def _hand_off(self, source: int, core_id: str, tokens: list[int]) -> None:
        """The KV mover: a finished prefill to a decode replica, its KV taken from `source`."""
        engine = self.engine
        clients: list[TransferClient] = engine.clients  # type: ignore[assignment]
        parent = engine.processor.parent_of(core_id)
        entry = engine.open_request(parent) if parent is not None else None
        original = next((r for r in entry.requests if r.request_id == core_id), None) if entry else None
        if parent is None or entry is None or original is None or not engine.processor.running(core_id):
            # aborted, or ended here by a stop string its first token completed
            clients[source].drop_kv([core_id])
            return
        moved = dataclasses.replace(original, wait_for=None, kv_transfer=KVTransferParams(output_token_ids=tokens))
        target = entry.replica if entry.replica in self.decode_ids else None
        tried: list[int] = []
        while True:
            if target is None:
                target = self._decode_target(original, tried)
            if target is None:
                engine.fail_request(parent, EngineStopped("no engine replica is running"))
                clients[source].drop_kv([core_id])
                return
            if clients[target].handoff(moved, entry.every_step, clients[source]):
                break
            tried.append(target)
            target = None
        engine.move(entry, target)  # (the request's first child to move: it is the decode replica's now)
        self.handoffs += 1

    def _decode_target(self, request: EngineCoreRequest, tried: list[int]) -> int | None:
        """The least loaded decode replica; with none running, a prefill one (it decodes too, more
        slowly than a dedicated one, rather than fail the request)."""
        for others in (self.prefill_ids, self.decode_ids):
            try:
                return self.engine.router.pick(request.prompt_token_ids, request.cache_salt, [*others, *tried]).replica
            except LookupError:
                continue
        return None


def disaggregated_engine(
    prefill: Sequence[TransferClient],
    decode: Sequence[TransferClient],
    processor: OutputProcessor,
    metrics: EngineMetrics,
    max_waiting: int = 256,
    log_interval: float = 10.0,
    restart: Restart | None = None,
) -> AsyncEngine:
    """An AsyncEngine over prefill then decode replicas, placed by `Disaggregation`."""
    placement = Disaggregation(len(prefill), len(decode))
    clients = [*prefill, *decode]
    return AsyncEngine(clients, processor, metrics, max_waiting, log_interval, restart=restart, placement=placement)


def _prefill_only(request: EngineCoreRequest) -> EngineCoreRequest:
    if request.max_tokens <= 1:
        return request
    return dataclasses.replace(request, max_tokens=1, kv_transfer=KVTransferParams(send=True))
