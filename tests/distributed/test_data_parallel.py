"""The AsyncEngine over several engine cores (data-parallel replicas) without Ray: two local cores in
this process, so that routing, outputs and the handling of a lost replica are tested in the default
run; tests/distributed/test_ray_replicas.py runs the same over Ray actors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, ReplicaLost
from tokenmill.engine.core import EngineCore
from tokenmill.engine.core_client import LocalCoreClient
from tokenmill.engine.engine_thread import EngineThread
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.llm import LLM
from tokenmill.outputs import EngineStats, OutputKind
from tokenmill.sampling_params import SamplingParams
from tokenmill.text.tokenizer import Tokenizer

BLOCK_BYTES = 24576  # one 16-token block of the tiny llama, float32


class ReplicaDied(BaseException):
    """What ends a replica's loop here (a core survives an Exception in a step: it fails the requests)."""


def local_client(config: EngineConfig) -> LocalCoreClient:
    thread = EngineThread()
    return LocalCoreClient(thread.run(lambda: EngineCore(config)), thread)


def make_engine(config: EngineConfig, replicas: int = 2, routing: str = "least_loaded", restart=None) -> AsyncEngine:
    clients = [local_client(config) for _ in range(replicas)]
    processor = OutputProcessor(Tokenizer(config.model), clients[0].limits, seed=config.seed)
    metrics = EngineMetrics("tiny", num_replicas=replicas)
    return AsyncEngine(clients, processor, metrics, log_interval=60, routing=routing, restart=restart)


@pytest.fixture
def config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=32 * BLOCK_BYTES, cpu_threads=1
    )


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    return [o async for o in engine.generate(request_id, prompt, params, output_kind=OutputKind.FINAL_ONLY)]


def all_free(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0


def test_two_replicas_share_the_requests_and_give_one_engines_greedy_outputs(config):
    prompts = [[5 + i, 17, 23 + 2 * i, 9, 40 + i] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    ref = LLM(config.model, max_model_len=256, kv_cache_memory=32 * BLOCK_BYTES, cpu_threads=1)
    expected = ref.generate([{"prompt_token_ids": p} for p in prompts], params)
    engine = make_engine(config)

    async def main() -> list:
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
        finally:
            await asyncio.sleep(0.05)
            assert all_free(engine)
            engine.stop()

    got = asyncio.run(main())
    for outs, ref_out in zip(got, expected, strict=True):
        a, b = outs[-1].outputs[0], ref_out.outputs[0]
        assert_same_up_to_near_tie(a.token_ids, top_logprobs(a.logprobs), b.token_ids, top_logprobs(b.logprobs))
    metrics = engine.metrics.render().decode()
    for replica in ("0", "1"):  # both served: three requests each
        assert (
            f'tokenmill:replica_requests_routed_total{{by="load",model_name="tiny",replica="{replica}"}} 3.0' in metrics
        )
    assert 'tokenmill:generation_tokens_total{model_name="tiny"} 48.0' in metrics  # the total over both


def test_prefix_routing_sends_a_shared_prefix_where_it_is_cached(config):
    groups = [[100 * g + i for i in range(48)] for g in range(2)]  # three 16-token blocks each
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(routing: str) -> tuple[int, int, list[int]]:
        engine = make_engine(config, routing=routing)

        async def main() -> tuple[list[int], EngineStats]:
            engine.start()
            try:
                where = []
                for k in range(3):  # one after the other, each group twice in a row
                    for g, prefix in enumerate(groups):
                        for j in range(2):
                            await collect(engine, f"{routing}-{g}-{k}-{j}", [*prefix, 7 + k, 8 + j], params)
                            where.append(engine.router.routed_by_prefix)
                return where, engine.stats()
            finally:
                engine.stop()

        where, stats = asyncio.run(main())
        return stats.prefix_cache_hits, stats.prefix_cache_queries, where

    hits, queries, by_prefix = run("prefix")
    assert by_prefix[-1] == 10  # all but each group's first request followed its prefix
    assert hits == 10 * 48  # ... and found it cached: three blocks each
    load_hits, load_queries, _ = run("least_loaded")
    assert load_queries == queries
    assert load_hits == 8 * 48  # in turn: each group's first two requests land on both replicas, both miss


def test_a_lost_replica_moves_requests_that_handed_nothing_and_fails_the_others(config, monkeypatch):
    engine = make_engine(config)
    lost = engine.clients[0]
    assert isinstance(lost, LocalCoreClient)
    steps = {"n": 0}
    real_step = lost.core.step
    go = threading.Event()

    def failing_step():  # the first step runs; the second waits for the test, then breaks
        steps["n"] += 1
        if steps["n"] >= 2:
            go.wait(30)
            raise ReplicaDied("replica 0 broke")
        return real_step()

    monkeypatch.setattr(lost.core, "step", failing_step)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main() -> tuple[object, list, list]:
        engine.start()
        try:
            streamed = engine.generate("streamed", [5, 6, 7], long)  # replica 0 (in turn), streamed: hands tokens
            first = await streamed.__anext__()
            other = asyncio.create_task(collect(engine, "other", [8, 9], long))  # replica 1
            await asyncio.sleep(0)
            quiet = asyncio.create_task(collect(engine, "quiet", [10, 11, 12], long))  # replica 0, not streamed
            await asyncio.sleep(0)
            assert engine._open["quiet"].replica == 0 and engine._open["other"].replica == 1
            go.set()
            with pytest.raises(ReplicaLost, match="replica 0 was lost"):
                async for _ in streamed:
                    pass
            return first, await quiet, await other
        finally:
            await asyncio.sleep(0.05)
            assert all_free(engine)  # the survivor holds nothing (the lost one freed its blocks too)
            engine.stop()

    first, quiet, other = asyncio.run(main())
    assert first.outputs[0].token_ids  # the streamed one had tokens before the loss
    assert len(quiet[-1].outputs[0].token_ids) == 40 and quiet[-1].finished  # started over on replica 1
    assert len(other[-1].outputs[0].token_ids) == 40
    assert not engine.healthy or engine._up == [False, True]
    metrics = engine.metrics.render().decode()
    assert 'tokenmill:replica_up{model_name="tiny",replica="0"} 0.0' in metrics


def test_a_restarted_replica_rejoins(config, monkeypatch):
    rejoined = asyncio.Event()
    engine = make_engine(config, restart=lambda i: local_client(config))
    real_rejoin = engine._rejoin

    def rejoin(*args):
        real_rejoin(*args)
        rejoined.set()

    monkeypatch.setattr(engine, "_rejoin", rejoin)
    lost = engine.clients[0]
    assert isinstance(lost, LocalCoreClient)
    monkeypatch.setattr(lost.core, "step", lambda: (_ for _ in ()).throw(ReplicaDied("broke")))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main() -> tuple[list, str]:
        engine.start()
        try:
            first = await collect(engine, "a", [5, 6], params)  # replica 0 breaks; started over on 1
            await asyncio.wait_for(rejoined.wait(), 60)
            assert engine._up == [True, True] and engine.clients[0] is not lost
            outs = [await collect(engine, f"b{i}", [5, 6], params) for i in range(2)]  # idle: in turn
            return [first, *outs], engine.metrics.render().decode()
        finally:
            engine.stop()

    outs, metrics = asyncio.run(main())
    assert all(o[-1].outputs[0].token_ids == outs[0][-1].outputs[0].token_ids for o in outs)
    assert 'tokenmill:replica_up{model_name="tiny",replica="0"} 1.0' in metrics
    assert 'tokenmill:replica_requests_routed_total{by="load",model_name="tiny",replica="0"} 2.0' in metrics


def test_without_ray_or_its_cluster_the_error_says_so(monkeypatch):
    import socket
    import sys

    from tokenmill.distributed.cluster import connect, ray_module

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"ray_address: nothing answers at 127.0.0.1:{port}"):
        connect(f"127.0.0.1:{port}", num_cpus=1)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ValueError, match="engine replicas run on Ray, which is not installed"):
        ray_module()
