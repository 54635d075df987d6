"""Prefill/decode disaggregation without Ray: a prefill core and a decode core in this process behind
an AsyncEngine placed by `Disaggregation`, the KV moved between them by their TransferConnectors. Outputs equal one
engine's; what moves and what does not; KV that does not arrive is recomputed; prefix caching works on
both sides; no blocks leak on either. tests/distributed/test_ray_replicas.py runs it over Ray."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import assert_same_up_to_near_tie, top_logprobs
from tokenmill.config import EngineConfig
from tokenmill.distributed.disaggregated import Disaggregation, LocalTransferClient, disaggregated_engine
from tokenmill.distributed.disaggregated import local_transfer_client as client
from tokenmill.distributed.kv_transfer import TransferConnector
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core import EngineCore
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.llm import LLM
from tokenmill.outputs import OutputKind
from tokenmill.sampling_params import SamplingParams
from tokenmill.text.tokenizer import Tokenizer

BLOCK_BYTES = 24576  # one 16-token block of the tiny llama, float32


@pytest.fixture
def config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_model_dir("llama")), max_model_len=256, kv_cache_memory=32 * BLOCK_BYTES, cpu_threads=1
    )


def make_engine(config: EngineConfig) -> AsyncEngine:
    prefill, decode = client(config), client(config)
    processor = OutputProcessor(Tokenizer(config.model), prefill.limits, seed=config.seed)
    return disaggregated_engine([prefill], [decode], processor, EngineMetrics("tiny", num_replicas=2), log_interval=60)


def handoffs(engine: AsyncEngine) -> int:
    assert isinstance(engine.placement, Disaggregation)
    return engine.placement.handoffs


async def run(engine, request_id, prompt, params, kind=OutputKind.FINAL_ONLY) -> list:
    return [o async for o in engine.generate(request_id, prompt, params, output_kind=kind)]


def free(c: LocalTransferClient) -> bool:
    s = c.core.stats()
    return s.kv_blocks_free == s.kv_blocks_total and s.running == s.waiting == 0


PROMPTS = [[5 + i, 17, 23 + 2 * i, 9, 40 + i] * (1 + 4 * i) for i in range(4)]  # 5 to 65 tokens


def test_moved_requests_give_one_engines_outputs_and_leak_nothing(config):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    ref = LLM(config.model, max_model_len=256, kv_cache_memory=32 * BLOCK_BYTES, cpu_threads=1)
    want_greedy = ref.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    want_sampled = ref.generate([{"prompt_token_ids": PROMPTS[2]}], sampled)[0]
    want_pair = ref.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=6, temperature=0, n=2))[0]
    engine = make_engine(config)
    prefill, decode = engine.clients

    async def main():
        engine.start()
        try:
            got = await asyncio.gather(
                *(run(engine, f"g{i}", p, greedy, OutputKind.DELTA if i % 2 else OutputKind.FINAL_ONLY)
                  for i, p in enumerate(PROMPTS)),
                run(engine, "s", PROMPTS[2], sampled),
                run(engine, "pair", PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, n=2)),
                run(engine, "one", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0)),
            )  # fmt: skip
            await asyncio.sleep(0.05)
            return got, prefill.core.stats(), decode.core.stats()
        finally:
            engine.stop()

    got, p_stats, d_stats = asyncio.run(main())
    for outs, want in zip(got[:4], want_greedy, strict=True):
        tokens = [t for o in outs for t in o.outputs[0].token_ids]  # (deltas for the streamed ones)
        logprobs = [e for o in outs for e in o.outputs[0].logprobs]
        b = want.outputs[0]
        assert_same_up_to_near_tie(tokens, top_logprobs(logprobs), b.token_ids, top_logprobs(b.logprobs))
    assert got[4][-1].outputs[0].token_ids == want_sampled.outputs[0].token_ids  # seeded: same draws by position
    assert [c.token_ids for c in got[5][-1].outputs] == [c.token_ids for c in want_pair.outputs]
    assert len(got[6][-1].outputs[0].token_ids) == 1 and got[6][-1].finished
    moved = 4 + 1 + 2  # "one" asked for one token: it ended on the prefill core
    assert p_stats.kv_transfer_sent == d_stats.kv_transfer_received == moved == handoffs(engine)
    assert p_stats.kv_transfer_sent_bytes == d_stats.kv_transfer_received_bytes > 0
    assert d_stats.kv_transfer_recomputed == 0 and d_stats.prompt_tokens == 0  # the decode core ran no prompt
    assert free(prefill) and free(decode)


def test_kv_that_does_not_arrive_is_recomputed_and_prefixes_are_cached_on_both_sides(config, monkeypatch):
    from tokenmill.distributed import kv_transfer

    engine = make_engine(config)
    prefill, decode = engine.clients
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)
    prompt = list(range(3, 3 + 40))  # two full blocks and 8 tokens
    ref = LLM(config.model, max_model_len=256, kv_cache_memory=32 * BLOCK_BYTES, cpu_threads=1)
    want = [r.outputs[0] for r in ref.generate([{"prompt_token_ids": p} for p in (prompt, [*prompt[:20], 99])], params)]

    async def main():
        engine.start()
        try:
            first = await run(engine, "a", prompt, params)
            again = await run(engine, "b", prompt, params)  # both sides hold the prompt's blocks now
            monkeypatch.setattr(prefill.transfer, "take", lambda request_id: None)  # lost on the way
            lost = await run(engine, "c", [*prompt[:20], 99], params)
            await asyncio.sleep(0.05)
            return first, again, lost, prefill.core.stats(), decode.core.stats()
        finally:
            engine.stop()

    first, again, lost, p_stats, d_stats = asyncio.run(main())
    for got, ref_out in ((first, want[0]), (again, want[0]), (lost, want[1])):
        a = got[-1].outputs[0]
        assert_same_up_to_near_tie(
            a.token_ids, top_logprobs(a.logprobs), ref_out.token_ids, top_logprobs(ref_out.logprobs)
        )
    assert p_stats.prefix_cache_hits == 32 + 16  # "b": two blocks; "c": one (its first 16 tokens)
    assert d_stats.prefix_cache_hits == 32 + 16  # the same: the blocks "a" received were cached there too
    assert d_stats.kv_transfer_received == 2 and d_stats.kv_transfer_recomputed == 1
    assert d_stats.prompt_tokens == 21 - 16  # only "c" ran prompt tokens on the decode core: past its hit
    assert free(prefill) and free(decode)
    outbox = prefill.transfer._outbox  # "c"'s copy, never taken, goes after the time-to-live
    assert len(outbox) == 1
    prefill.transfer._expire(max(t for t, _ in outbox.values()) + kv_transfer.OUTBOX_TTL_S + 1)
    assert not outbox


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("prefill=1", "both"),
        ("prefill=1,decode=0", "positive integers"),
        ("prefill=2,decode=x", "positive integers"),
        ("prefill=1,prefill=2", "positive integers"),
        ("decode=1,encode=1", "positive integers"),
    ],
)
def test_a_bad_disaggregate_value_names_the_setting(text, why):
    from tokenmill.distributed.config import ParallelConfig

    with pytest.raises(ValueError, match=f"disaggregate: expected prefill=P,decode=D.*{why}"):
        ParallelConfig.disaggregate(text)
    good = ParallelConfig.disaggregate("prefill=1,decode=2")
    assert good.disaggregated and good.uses_ray and good.num_replicas == 3


def test_speculative_decoding_is_refused_on_a_disaggregated_core(config):
    import dataclasses

    spec = dataclasses.replace(config, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="speculative_config: not with prefill/decode disaggregation"):
        EngineCore(spec, TransferConnector(config.block_size))
