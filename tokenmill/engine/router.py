"""Router: which data-parallel replica a new request goes to — least-loaded, or prefix-cache aware.

Pure Python, on the front end's event loop. `least_loaded`: the live replica with the fewest open
requests (ties in turn). `prefix`: the live replica that holds the longest cached prefix of the
prompt, as the router saw it: for each replica it remembers the chained block hashes of the prompts
it sent there (the same hashes as the prefix cache: `sched.block_hash`, block size and salt as the
replicas use), most recent last, at most the replica's KV blocks of them, so that what a replica had
to evict is forgotten about as often here. A prefix shorter than `min_prefix_blocks`, or a replica
with `max_imbalance` more open requests than the least loaded, falls back to load: a short shared
prefix is not worth a queue.

A replica that is lost forgets everything (its cache went with it); one that rejoins starts empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.sched.block_hash import chain_hashes

ROUTING = ("least_loaded", "prefix")


@dataclass(frozen=True)
class RouterConfig:
    policy: str  # one of ROUTING
    block_size: int
    capacity_blocks: int  # a replica's KV blocks: the most hashes remembered for it
    min_prefix_blocks: int = 2
    max_imbalance: int = 8  # open requests above the least loaded replica's that a prefix may cost

    def __post_init__(self) -> None:
        if self.policy not in ROUTING:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING)}, got {self.policy!r}")


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int  # leading prompt blocks the router believes the replica has cached
    by_prefix: bool  # chosen for its prefix (else for its load)


class Router:
    def __init__(self, num_replicas: int, config: RouterConfig) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size: expected a positive integer, got {num_replicas}")
        self.config = config
        self.num_replicas = num_replicas
        self.alive = [True] * num_replicas
        self.load = [0] * num_replicas  # open requests per replica (the engine keeps this count)
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = 0
        self.routed_by_prefix = 0
        self.routed_by_load = 0

    def pick(self, token_ids: Sequence[int], salt: str | None, exclude: Sequence[int] = ()) -> Route:
        """The replica for a prompt, among the live ones not in `exclude`; a LookupError if none is left."""
        live = [i for i in range(self.num_replicas) if self.alive[i] and i not in exclude]
        if not live:
            raise LookupError("no engine replica is available")
        least = min(self.load[i] for i in live)
        if self.config.policy == "prefix":
            hashes = chain_hashes(token_ids, self.config.block_size, salt)
            matched = {i: self._matched(i, hashes) for i in live}
            best = max(live, key=lambda i: (matched[i], -self.load[i]))
            fits = self.load[best] - least <= self.config.max_imbalance
            if matched[best] >= self.config.min_prefix_blocks and fits:
                self.routed_by_prefix += 1
                self._remember(best, hashes)
                return Route(best, matched[best], by_prefix=True)
        choice = self._least_loaded(live, least)
        self.routed_by_load += 1
        if self.config.policy == "prefix":
            self._remember(choice, hashes)
            return Route(choice, matched[choice], by_prefix=False)
        return Route(choice, 0, by_prefix=False)

    def _least_loaded(self, live: list[int], least: int) -> int:
        """The least loaded live replica; among equals, the next after the previous choice."""
        tied = [i for i in live if self.load[i] == least]
        after = [i for i in tied if i >= self._turn]
        choice = after[0] if after else tied[0]
        self._turn = (choice + 1) % self.num_replicas
        return choice

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        seen = self._seen[replica]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.config.capacity_blocks:
            seen.popitem(last=False)

    def lost(self, replica: int) -> None:
        """A replica is gone: nothing goes to it, and its cache is forgotten."""
        self.alive[replica] = False
        self._seen[replica].clear()
        self.load[replica] = 0

    def rejoined(self, replica: int) -> None:
        self.alive[replica] = True
