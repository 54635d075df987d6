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


def test_final_only_requests_are_handed_over_when_done_streamed_ones_every_step(tiny_model_dir, monkeypatch):
    from tokenmill.engine import core_loop
    from tokenmill.outputs import OutputKind

    monkeypatch.setattr(core_loop, "OUTPUT_INTERVAL_S", 60.0)  # only urgency hands steps over
    config = EngineConfig(  # (a forward a step: decode runs would hand several tokens over a step)
        model=str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory=16 * 24576, decode_steps=1
    )
    server = build_server(config)
    engine = server.engine
    handed: list[int] = []
    real = engine._on_steps
    monkeypatch.setattr(engine, "_on_steps", lambda i, c, steps: (handed.append(len(steps)), real(i, c, steps)))

    async def run(kind, stop=()) -> list:
        p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=stop)
        return [o async for o in engine.generate(f"r{len(handed)}", [5, 6, 7], p, output_kind=kind)]

    async def main() -> tuple[list, list, list]:
        engine.start()
        try:
            final = await run(OutputKind.FINAL_ONLY)
            final_calls = list(handed)
            handed.clear()
            streamed = await run(OutputKind.DELTA)
            streamed_calls = list(handed)
            handed.clear()
            await run(OutputKind.FINAL_ONLY, stop=("zzz-never",))  # stop strings are matched every step
            return final, (final_calls, streamed_calls, list(handed)), streamed
        finally:
            engine.stop()

    final, (final_calls, streamed_calls, stop_calls), streamed = asyncio.run(main())
    assert final_calls == [6]  # six steps (one prompt, five decodes), handed over once, at the end
    assert streamed_calls == [1] * 6 and stop_calls == [1] * 6
    assert len(final) == 1 and final[0].outputs[0].token_ids == [t for o in streamed for t in o.outputs[0].token_ids]
    assert not engine.clients[0].loop.every_step  # nothing left behind
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
