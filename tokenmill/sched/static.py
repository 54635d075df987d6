"""StaticScheduler: the legacy static-batching baseline, behind the Scheduler's interface.

A batch of up to `max_num_seqs` waiting requests is admitted whole, with KV reserved up front for
every member's prompt + max_tokens. Members that finish go idle; nobody joins until the whole batch
is done. Kept so that every claim about continuous batching is a measured ratio against it.
"""

from __future__ import annotations

from tokenmill.outputs import NewRequestData, ScheduledChunk
from tokenmill.sched.draft_policy import DraftPolicy, NoDrafts
from tokenmill.sched.kv_connector import KVConnector
from tokenmill.sched.kv_manager import KVManager
from tokenmill.sched.scheduler import Scheduler, SchedulerConfig


class StaticScheduler(Scheduler):
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        connector: KVConnector | None = None,
        drafts: DraftPolicy | None = None,
    ) -> None:
        """As the Scheduler's; `drafts` is ignored: the baseline decodes a token a step (its KV is
        reserved up front)."""
        super().__init__(config, kv, connector, NoDrafts())

    def _admit(self, budget: int, chunks: list[ScheduledChunk], new: list[NewRequestData], now: float) -> int:
        if self.running:
            return budget  # the current batch is still running: nobody joins
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            full = request.num_prompt_tokens + request.max_tokens
            if not self.kv.allocate(request.request_id, full):
                break
            self._start(request, new, now)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0:
                chunks.append(self._chunk(request, num_new))
                budget -= num_new
        return budget
