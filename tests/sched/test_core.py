"""Block pool, KV manager and scheduler: exact block ids, free counts, chunking, preemption, static batching."""

from __future__ import annotations

import pytest

from tokenmill.outputs import StepOutput
from tokenmill.request import Request, RequestStatus, RequestTimes
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.block_hash import block_hash, chain_hashes
from tokenmill.sched.block_pool import BlockPool
from tokenmill.sched.kv_manager import KVManager
from tokenmill.sched.scheduler import Scheduler, SchedulerConfig
from tokenmill.sched.static import StaticScheduler


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, **params: object) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        seed=0,
        max_tokens=max_tokens,
        eos_token_ids=(1,),
        times=RequestTimes(arrival=0.0),
    )


def run_step(s: Scheduler, token: int = 7) -> tuple[dict[str, tuple[int, int]], list[Request]]:
    """One step where every sampling chunk produces `token`; returns {id: (start, n)} and changed requests."""
    out = s.schedule(now=0.0)
    sampled = {c.request_id: [token] for c in out.chunks if c.sample}
    changed = s.update(out, StepOutput(sampled=sampled), now=0.0)
    return {c.request_id: (c.start_position, len(c.token_ids)) for c in out.chunks}, changed


def test_block_pool_ids_refcounts_and_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free == 1
    pool.free([1, 0])
    assert pool.num_free == 3
    assert pool.allocate(3) == [3, 1, 0]  # FIFO: the oldest free block first
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        pool.allocate(1)
    pool.free([2])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([2])


def test_kv_manager_grows_a_block_at_a_time_and_frees_tail_first():
    kv = KVManager(num_blocks=6, block_size=4)
    assert kv.allocate("a", 5) and kv.block_table("a") == [0, 1]
    assert kv.allocate("a", 8) and kv.block_table("a") == [0, 1]
    assert kv.allocate("a", 9) and kv.block_table("a") == [0, 1, 2]
    assert kv.allocate("b", 12) and kv.block_table("b") == [3, 4, 5]
    assert not kv.allocate("a", 13) and kv.block_table("a") == [0, 1, 2]  # nothing changes on failure
    kv.free("a")
    assert kv.num_free_blocks == 3
    assert kv.allocate("c", 4) and kv.block_table("c") == [2]  # tail first: 2 was freed first
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 6


def test_chunked_prefill_mixes_with_decodes_within_the_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), KVManager(32, 4))
    s.add_request(make_request("a", 3))
    s.add_request(make_request("b", 13))
    chunks, _ = run_step(s)
    assert chunks == {"a": (0, 3), "b": (0, 5)}  # b's prompt is chunked
    chunks, _ = run_step(s)
    assert chunks == {"a": (3, 1), "b": (5, 7)}  # a decodes while b's prefill continues
    chunks, _ = run_step(s)
    assert chunks == {"a": (4, 1), "b": (12, 1)}  # b's last prompt token, which samples its first token
    assert s.requests["b"].output_token_ids == [7]
    assert s.requests["a"].output_token_ids == [7, 7, 7]


def test_finish_on_eos_stop_token_and_max_tokens():
    s = Scheduler(SchedulerConfig(4, 64, 64), KVManager(32, 4))
    s.add_request(make_request("eos", 2, max_tokens=5))
    s.add_request(make_request("ignore", 2, max_tokens=3, ignore_eos=True))
    s.add_request(make_request("stopid", 2, max_tokens=5, stop_token_ids=[1, 9]))
    _, changed = run_step(s, token=1)
    status = {r.request_id: r.status for r in changed}
    assert status["eos"] is RequestStatus.FINISHED_STOPPED
    assert status["stopid"] is RequestStatus.FINISHED_STOPPED and changed[2].stop_reason == 1
    assert status["ignore"] is RequestStatus.RUNNING
    run_step(s, token=1)
    _, changed = run_step(s, token=1)
    assert changed[0].status is RequestStatus.FINISHED_LENGTH and len(changed[0].output_token_ids) == 3
    assert not s.has_unfinished() and s.kv.num_free_blocks == 32


def test_model_length_and_cache_limits_are_asserted():
    # the engine's front door refuses these with clear errors (tests/engine/test_request_checks.py);
    # the scheduler trusts what passed it and only asserts
    s = Scheduler(SchedulerConfig(4, 64, max_model_len=20), KVManager(4, 4))
    with pytest.raises(AssertionError, match="past max_model_len 20"):
        s.add_request(make_request("long", 18, max_tokens=4))
    with pytest.raises(AssertionError, match="more blocks than the cache"):
        s.add_request(make_request("big", 15, max_tokens=4))
    s.add_request(make_request("ok", 12, max_tokens=4))
    with pytest.raises(AssertionError, match="already queued"):
        s.add_request(make_request("ok", 2))


def test_preemption_frees_the_newest_and_readmits_it():
    # 6 blocks of 4 tokens; two requests of 8-token prompts that each want 8 more tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), KVManager(6, 4))
    s.add_request(make_request("old", 8, max_tokens=8))
    s.add_request(make_request("new", 8, max_tokens=8))
    chunks, _ = run_step(s)  # 2 + 2 blocks
    assert chunks == {"old": (0, 8), "new": (0, 8)}
    run_step(s)  # 9 tokens each: 3 + 3 blocks, all 6 used
    run_step(s)  # 10
    run_step(s)  # 11
    run_step(s)  # 12
    chunks, _ = run_step(s)  # "old" needs a 4th block: "new" is preempted
    assert chunks == {"old": (12, 1)}
    new = s.waiting[0]
    assert new.request_id == "new" and new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.num_preemptions == 1 and s.kv.block_table("new") == []
    while "old" in s.requests:
        run_step(s)
    chunks, _ = run_step(s)  # re-admitted: prompt and the tokens it had generated are recomputed
    assert chunks == {"new": (0, 13)}
    while s.has_unfinished():
        run_step(s)
    assert s.kv.num_free_blocks == 6


def test_max_num_seqs_and_fcfs_admission():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), KVManager(32, 4))
    for rid in "abc":
        s.add_request(make_request(rid, 4, max_tokens=2))
    chunks, _ = run_step(s)
    assert set(chunks) == {"a", "b"}
    chunks, _ = run_step(s)  # a and b finish (2 tokens each)
    chunks, _ = run_step(s)
    assert set(chunks) == {"c"}


def test_abort_frees_blocks_wherever_the_request_is():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), KVManager(8, 4))
    s.add_request(make_request("run", 6))
    s.add_request(make_request("wait", 6))
    run_step(s)
    s.finish_request("run", RequestStatus.FINISHED_ABORTED)
    s.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 8
    assert s.schedule(now=0.0).finished_request_ids == ["run", "wait"]


def test_static_batching_reserves_up_front_and_admits_only_between_batches():
    s = StaticScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), KVManager(32, 4))
    s.add_request(make_request("a", 4, max_tokens=1))
    s.add_request(make_request("b", 4, max_tokens=5))
    s.add_request(make_request("c", 4, max_tokens=1))
    chunks, _ = run_step(s)
    assert set(chunks) == {"a", "b"}
    assert s.kv.block_table("b") == [2, 3, 4]  # prompt + max_tokens = 9 tokens reserved at admission
    for _ in range(4):
        chunks, _ = run_step(s)
        assert set(chunks) == {"b"}  # a finished and idles; c may not join
    chunks, _ = run_step(s)
    assert set(chunks) == {"c"}
    assert not s.has_unfinished() and s.kv.num_free_blocks == 32


def test_a_request_that_needs_the_whole_cache_is_admitted_when_alone():
    kv = KVManager(num_blocks=4, block_size=4, watermark_blocks=1)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    s.add_request(make_request("big", 15, max_tokens=1))  # 16 tokens: all 4 blocks
    chunks, _ = run_step(s)
    assert chunks == {"big": (0, 15)}
    assert not s.has_unfinished() and kv.num_free_blocks == 4


def test_block_pool_prefix_cache_shares_keeps_and_evicts_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    assert pool.lookup(b"h0") == 0 and pool.lookup(b"h1") == 1
    pool.share(0)  # a second request hits block 0
    assert pool.ref_counts[:2] == [2, 1]
    pool.free([1, 0])  # the first request finishes, tail first
    assert pool.ref_counts[:2] == [1, 0] and pool.num_free == 3
    pool.free([0])
    assert pool.num_free == 4 and pool.lookup(b"h0") == 0  # free, and still cached
    pool.share(0)  # a hit on a free cached block takes it out of the free queue
    assert pool.num_free == 3 and pool.ref_counts[0] == 1
    assert pool.allocate(2) == [2, 3]  # least recently used first: the queue is 2, 3, 1
    assert pool.allocate(1) == [1] and pool.num_evictions == 1 and pool.lookup(b"h1") is None
    assert pool.lookup(b"h0") == 0


def test_prefix_hits_are_whole_blocks_and_leave_the_last_token_to_compute():
    kv = KVManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    first = make_request("a", 12, max_tokens=5)
    s.add_request(first)
    run_step(s)
    assert kv.pool.num_cached == 3  # 12 computed prompt tokens fill 3 blocks
    second = make_request("b", 12, max_tokens=2)  # the same 12-token prompt
    s.add_request(second)
    chunks, _ = run_step(s)
    assert chunks["b"] == (8, 4)  # 2 blocks hit: at most (12 - 1) // 4; the last block is computed
    assert second.num_cached_tokens == 8 and kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.pool.ref_counts[kv.block_table("a")[0]] == 2
    short = make_request("c", 3, max_tokens=1)  # shorter than a block: no hit possible
    s.add_request(short)
    run_step(s)
    assert short.num_cached_tokens == 0
    while s.has_unfinished():
        run_step(s)
    assert kv.num_free_blocks == 16
    assert s.prefix_hits == 8 and s.prefix_queries == 12 + 12 + 3


def test_prefix_cache_salt_and_prompt_logprobs_never_share():
    kv = KVManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    a = make_request("a", 12, max_tokens=1)
    a.cache_salt = "tenant-1"
    s.add_request(a)
    run_step(s)
    b = make_request("b", 12, max_tokens=1)
    b.cache_salt = "tenant-2"
    c = make_request("c", 12, max_tokens=1, prompt_logprobs=1)
    c.cache_salt = "tenant-1"
    d = make_request("d", 12, max_tokens=1)
    d.cache_salt = "tenant-1"
    for r in (b, c, d):
        s.add_request(r)
    chunks, _ = run_step(s)
    assert chunks["b"] == (0, 12) and chunks["c"] == (0, 12) and chunks["d"] == (8, 4)
    assert kv.num_free_blocks == 16


def test_block_hashes_chain_on_the_parent():
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    abc = chain_hashes(a + b + c, 4, None)
    ac = chain_hashes(a + c, 4, None)
    assert abc[0] == ac[0] == block_hash(None, a, None)
    assert abc[1] == block_hash(abc[0], b, None) and abc[2] == block_hash(abc[1], c, None)
    assert ac[1] == block_hash(ac[0], c, None) != abc[2]  # the same tokens after another parent
    assert chain_hashes(a + b + c, 4, None, parent=abc[0])[0] != abc[0]  # a chain continued from a parent
    assert chain_hashes(a + b + [13], 4, None) == abc[:2]  # a trailing partial block gets no hash
    assert chain_hashes(a, 4, "salt") != chain_hashes(a, 4, None)
    # the KV manager finds only the longest chain of leading blocks: C after A is not C after A + B
    kv = KVManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert kv.allocate("abc", 12)
    kv.cache_full_blocks("abc", a + b + c, None)
    blocks, hashes = kv.find_prefix(a + c, None)
    assert blocks == kv.block_table("abc")[:1] and hashes == abc[:1]
    blocks, _ = kv.find_prefix(c, None)
    assert blocks == []


def test_decode_runs_take_only_blocks_left_over_and_never_preempt():
    """A run's slots (decode_steps) are asked for after every running request's next token has its own,
    and above the watermark: with three blocks of 4 for two requests, runs of 4 preempt exactly when a step
    a token does (A's fifth token, the third step), not at the first decode; a run is granted only where
    its slots are spare."""
    for steps in (1, 4):
        s = Scheduler(SchedulerConfig(8, 64, 64, steps), KVManager(3, 4))
        s.add_request(make_request("A", 3, max_tokens=8, temperature=0))
        s.add_request(make_request("B", 4, max_tokens=8, temperature=0))
        granted, preemptions = [], []
        for _ in range(3):
            out = s.schedule(now=0.0)
            granted += [c.num_steps for c in out.chunks]
            s.update(out, StepOutput(sampled={c.request_id: [7] for c in out.chunks if c.sample}), now=0.0)
            preemptions.append(s.num_preemptions)
        assert preemptions == [0, 0, 1]
        # runs of 4: A's (slot 4 in a second block) refused, B's (slots 4-7: the block its next token took) granted
        assert granted == ([1] * 5 if steps == 1 else [1, 1, 1, 4, 1])
    s = Scheduler(SchedulerConfig(8, 64, 64, 4), KVManager(8, 4))
    s.add_request(make_request("A", 3, max_tokens=8, temperature=0))
    out = s.schedule(now=0.0)  # the prompt
    s.update(out, StepOutput(sampled={"A": [7]}), now=0.0)
    out = s.schedule(now=0.0)  # a decode, blocks to spare: a run of 4 (positions 3-6: the second block sent)
    (chunk,) = out.chunks
    assert chunk.num_steps == 4 and len(s.kv.block_table("A")) == 2 and chunk.new_block_ids == s.kv.block_table("A")[1:]
    s.update(out, StepOutput(sampled={"A": [7, 8, 9, 10]}), now=0.0)
    # its token and the run's first three went through the model; the fourth is the next one's input
    assert s.requests["A"].num_computed_tokens == 7 and s.requests["A"].output_token_ids == [7, 7, 8, 9, 10]
