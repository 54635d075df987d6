"""The data-parallel router: least-loaded in turn, prefix-aware with its fallbacks, lost replicas."""

from __future__ import annotations

import pytest

from tokenmill.engine.router import Router, RouterConfig
from tokenmill.sched.block_hash import chain_hashes


def prompt(group: int, tail: int, blocks: int = 4, block_size: int = 4) -> list[int]:
    """`blocks` full blocks shared by a group, then a tail of its own."""
    return [1000 * group + i for i in range(blocks * block_size)] + [tail, tail + 1]


def test_least_loaded_takes_turns_among_equals_and_prefers_the_idle():
    r = Router(3, RouterConfig("least_loaded", block_size=4, capacity_blocks=64))
    assert [r.pick([1, 2, 3], None).replica for _ in range(4)] == [0, 1, 2, 0]  # loads stay equal (0)
    r.load[:] = [2, 0, 1]
    assert r.pick([1, 2, 3], None).replica == 1
    r.load[:] = [0, 0, 0]
    r.lost(1)
    assert {r.pick([1], None).replica for _ in range(4)} == {0, 2}
    with pytest.raises(LookupError, match="no engine replica"):
        r.pick([1], None, exclude=[0, 2])
    r.rejoined(1)
    assert 1 in {r.pick([1], None).replica for _ in range(3)}


def test_prefix_routing_keeps_a_group_on_the_replica_that_cached_it():
    r = Router(2, RouterConfig("prefix", block_size=4, capacity_blocks=64))
    first = [r.pick(prompt(g, 0), None) for g in range(4)]  # nothing cached: by load, in turn
    assert [x.replica for x in first] == [0, 1, 0, 1] and not any(x.by_prefix for x in first)
    again = [r.pick(prompt(g, 7), None) for g in range(4)]  # other tails, same prefixes
    assert [x.replica for x in again] == [0, 1, 0, 1]
    assert all(x.by_prefix and x.matched_blocks == 4 for x in again)
    # a salt is part of the hash: the same tokens under another salt share nothing
    assert r.pick(prompt(0, 7), "tenant-b").matched_blocks == 0


def test_prefix_routing_falls_back_to_load_for_short_prefixes_and_busy_replicas():
    config = RouterConfig("prefix", block_size=4, capacity_blocks=64, min_prefix_blocks=2, max_imbalance=3)
    r = Router(2, config)
    assert r.pick(prompt(0, 0), None).replica == 0
    r.load[:] = [1, 0]
    short = r.pick([*prompt(0, 0, blocks=1), 5, 6, 7, 8], None)  # one shared block: not worth a queue
    assert short.replica == 1 and not short.by_prefix
    r.load[:] = [3, 0]
    assert r.pick(prompt(0, 1), None).replica == 0  # 3 more open requests: within the allowed imbalance
    r.load[:] = [4, 0]
    busy = r.pick(prompt(0, 2), None)
    assert busy.replica == 1 and not busy.by_prefix
    assert busy.matched_blocks == 1  # (the short prompt above left its one block there)


def test_what_a_replica_could_not_hold_and_a_lost_replica_are_forgotten():
    r = Router(2, RouterConfig("prefix", block_size=4, capacity_blocks=8))
    r.pick(prompt(0, 0), None)  # 4 blocks on replica 0
    r.load[:] = [0, 0]
    r.pick(prompt(1, 0), None)  # replica 1
    r.load[:] = [0, 5]
    r.pick(prompt(2, 0), None)  # replica 0 (idle), 4 more blocks: 8 held
    assert r.pick(prompt(0, 3), None).matched_blocks == 4
    r.load[:] = [0, 5]
    r.pick(prompt(3, 0), None)  # 4 more: group 2 (the least recent) goes
    hashes = chain_hashes(prompt(2, 0), 4, None)
    assert r._matched(0, hashes) == 0 and r._matched(0, chain_hashes(prompt(0, 0), 4, None)) == 4
    r.lost(0)
    assert r._matched(0, chain_hashes(prompt(0, 0), 4, None)) == 0


def test_bad_routing_names_the_setting():
    with pytest.raises(ValueError, match="routing: expected one of least_loaded, prefix"):
        RouterConfig("random", block_size=4, capacity_blocks=8)
