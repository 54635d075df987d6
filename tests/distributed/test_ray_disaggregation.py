"""Prefill/decode disaggregation on Ray behind the server (`--disaggregate prefill=1,decode=1`): one
engine's greedy outputs, the KV moved actor to actor and counted, nothing leaked on either side; a
decode replica killed mid-stream; a handoff whose prefill replica is gone recomputes its prompt."""

from __future__ import annotations

import threading

import pytest

from tests.distributed.test_ray_replicas import all_free, assert_greedy_like_one_engine, body, client, wait_until
from tests.server_harness import start_server
from tokenmill.distributed.config import ParallelConfig

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def served(tiny_model_dir, ray_cluster):
    parallel = ParallelConfig.disaggregate("prefill=1,decode=1")  # a step a token: as test_ray_replicas
    server = start_server(str(tiny_model_dir("llama")), blocks=32, decode_steps=1, parallel=parallel, cpu_threads=2)
    yield server
    server.stop()


def test_the_kv_moves_between_actors_and_outputs_equal_one_engines(served, tiny_model_dir):
    prompts = [[5 + i, 17, 23 + 2 * i, 9, 40 + i] * (1 + 3 * i) for i in range(4)]
    assert_greedy_like_one_engine(served, str(tiny_model_dir("llama")), prompts)
    wait_until(lambda: all_free(served))
    prefill, decode = (c.stats() for c in served.server.engine.clients)
    assert prefill.kv_transfer_sent == decode.kv_transfer_received >= len(prompts)
    assert prefill.kv_transfer_sent_bytes == decode.kv_transfer_received_bytes > 0
    assert decode.prompt_tokens == 0 and decode.kv_transfer_recomputed == 0
    metrics = served.server.engine.metrics.render().decode()
    assert 'tokenmill:kv_transfer_received_bytes_total{model_name="tiny"}' in metrics


def test_a_lost_decode_replica_fails_its_stream_and_restarts_its_quiet_request(served):
    """The quiet one starts over on the prefill replica, which decodes it too while the decode replica
    is replaced."""
    engine = served.server.engine
    events: list[dict] = []
    done: dict[str, object] = {}

    def stream() -> None:
        import json

        with (
            client() as c,
            c.stream("POST", f"{served.base_url}/v1/completions", json=body([5, 6, 7], 240, stream=True)) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))

    def quiet() -> None:
        with client() as c:
            done["quiet"] = c.post(f"{served.base_url}/v1/completions", json=body([8, 9, 10], 240))

    streamer, waiter = threading.Thread(target=stream), threading.Thread(target=quiet)
    streamer.start()
    wait_until(lambda: len(events) >= 2)  # its first token (from prefill) and one from decode
    waiter.start()
    wait_until(lambda: len(engine._open) == 2 and all(e.replica == 1 for e in engine._open.values()))
    victim = engine.clients[1]
    ray.kill(victim.actor, no_restart=True)
    streamer.join(60)
    waiter.join(120)
    assert events[-1]["error"]["code"] == "replica_lost"
    quiet_response = done["quiet"]
    assert quiet_response.status_code == 200 and quiet_response.json()["usage"]["completion_tokens"] == 240
    wait_until(lambda: engine._up == [True, True] and engine.clients[1] is not victim, timeout=120)
    wait_until(lambda: all_free(served))


def test_a_handoff_whose_kv_cannot_come_is_left_to_recompute(ray_cluster):
    from tokenmill.distributed.replica import _fetch

    @ray.remote(num_cpus=0)
    class Slow:
        def wait(self) -> None:
            import time

            time.sleep(30)

    actor = Slow.remote()
    ref = actor.wait.remote()
    ray.kill(actor, no_restart=True)  # the prefill replica dies before its KV is fetched
    assert _fetch(ref) is None
