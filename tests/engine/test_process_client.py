"""ProcessCoreClient: an engine core in a spawned child process behind the CoreClient interface.

The AsyncEngine over it gives the outputs the offline engine gives (greedy, and seeded sampling);
an abort frees the request's blocks in the child; a stop ends the child; a load that fails, or is
killed, says so; a child that dies fails its open requests instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine import build_async_engine
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.process_client import CoreLoadFailed, ProcessCoreClient, spawn_core
from tokenmill.errors import RequestFailed

PROMPTS = ["Hello there", "The capital of", "1 2 3 4"]
KV = 64 * 24576


def config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), max_model_len=256, kv_cache_memory=KV)


async def served(cfg: EngineConfig) -> tuple[AsyncEngine, ProcessCoreClient]:
    client = await asyncio.to_thread(spawn_core(cfg, "test").wait_ready)
    engine = build_async_engine(cfg, EngineMetrics("test"), [client], None)
    engine.start()
    return engine, client


async def collect(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams) -> str:
    text = ""
    async for out in engine.generate(request_id, prompt, params):
        text += "".join(c.text_delta for c in out.outputs)
    return text


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_outputs_equal_the_offline_engines(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=KV)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    expected += [o.outputs[0].text for o in llm.generate(PROMPTS, seeded)]

    async def run() -> tuple[list[str], int]:
        engine, client = await served(config(folder))
        try:
            jobs = [collect(engine, f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
            jobs += [collect(engine, f"s{i}", p, seeded) for i, p in enumerate(PROMPTS)]
            texts = await asyncio.gather(*jobs)
            stats = engine.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
            return list(texts), client.pid
        finally:
            await asyncio.to_thread(engine.stop)

    texts, pid = asyncio.run(run())
    assert texts == expected
    assert pid != os.getpid() and gone(pid)


def test_an_abort_frees_the_requests_blocks_in_the_child(tiny_model_dir) -> None:
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def run() -> None:
        engine, _ = await served(config(tiny_model_dir("llama")))
        try:
            stream = engine.generate("long", "Once upon a time", long)
            await anext(stream)  # running in the child now
            await stream.aclose()  # the client gone: aborted
            for _ in range(200):
                stats = engine.stats()
                if stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats.kv_blocks_free == stats.kv_blocks_total and stats.aborted == 1
            assert stats.generated_tokens < 200
        finally:
            await asyncio.to_thread(engine.stop)

    asyncio.run(run())


def test_a_child_that_dies_fails_its_open_requests(tiny_model_dir) -> None:
    async def run() -> None:
        engine, client = await served(config(tiny_model_dir("llama")))
        try:
            stream = engine.generate("r", "Once", SamplingParams(max_tokens=250, temperature=0, ignore_eos=True))
            await anext(stream)
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(RequestFailed, match="process died"):
                async for _ in stream:
                    pass
            assert not engine.healthy
        finally:
            await asyncio.to_thread(engine.stop)
        assert gone(client.pid)

    asyncio.run(run())


def test_a_load_that_fails_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weights, no sizes
    child = spawn_core(EngineConfig(model=str(tmp_path)), "broken")
    with pytest.raises(CoreLoadFailed, match="broken: the model could not be loaded"):
        child.wait_ready()
    assert not child.alive


def test_a_load_killed_midway_ends_its_wait(tiny_model_dir) -> None:
    child = spawn_core(config(tiny_model_dir("llama")), "killed")
    child.kill(close=False)
    with pytest.raises(CoreLoadFailed, match="ended while loading"):
        child.wait_ready()
    assert not child.alive and child.process.returncode == -signal.SIGKILL
