"""What the chaos tests share: slowing a served engine's steps, and the check every test ends with
(nothing running or waiting, every KV block free, nothing open in the front end)."""

from __future__ import annotations

import time

from tests.server_harness import RunningServer


def slow_steps(running: RunningServer, seconds: float) -> None:
    """Each step of `running`'s engine sleeps `seconds` first: a request still runs when the next
    arrives, whatever the machine's speed."""
    worker = running.server.engine.clients[0].core.worker
    execute = worker.execute

    def slow(scheduled):
        time.sleep(seconds)
        return execute(scheduled)

    worker.execute = slow


def assert_idle(running: RunningServer) -> None:
    stats = running.wait_all_free(timeout=10)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0, stats
    assert running.server.engine.num_open == 0 and not running.server.engine.processor.has_unfinished()
