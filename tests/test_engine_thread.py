"""EngineThread runs what it is given on one thread, in order, and hands back results and errors;
the server builds its core on the thread that then steps it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine import core as core_module
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.launch import build_server


def test_jobs_run_in_order_on_one_thread_and_errors_come_back():
    thread = EngineThread(name="t")
    seen: list[tuple[int, int]] = []
    futures = [thread.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    for f in futures:
        f.result(timeout=10)
    assert [i for i, _ in seen] == list(range(5))
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        thread.run(lambda: 1 / 0)
    assert thread.run(lambda: threading.current_thread().name) == "t"  # still serving after an error


def test_the_server_steps_its_core_on_the_thread_that_built_it(tiny_model_dir, monkeypatch):
    threads: dict[str, int] = {}
    real_init, real_step = core_module.EngineCore.__init__, core_module.EngineCore.step

    def init(self, config):
        threads["built"] = threading.get_ident()
        real_init(self, config)

    def step(self):
        threads["stepped"] = threading.get_ident()
        return real_step(self)

    monkeypatch.setattr(core_module.EngineCore, "__init__", init)
    monkeypatch.setattr(core_module.EngineCore, "step", step)
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory=16 * 24576)
    server = build_server(config)

    async def one() -> None:
        server.engine.start()
        try:
            async for _ in server.engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=2)):
                pass
        finally:
            server.engine.stop()

    asyncio.run(one())
    assert threads["built"] == threads["stepped"] != threading.get_ident()
