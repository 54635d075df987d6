"""BlockPool: the fixed set of KV cache blocks, their reference counts, the LRU free queue and the
hash -> block map of the prefix cache.

Pure Python. A block is an index into the paged K/V tensors; the pool never touches tensors. Free
blocks (ref count 0) wait in a queue, least recently used first: fresh blocks are taken from its
head, freed blocks go to its tail. A free block that holds a cached full block keeps its hash until
it is taken for new tokens (an eviction), so a later request with the same prefix can still hit it.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block holding that full block's KV
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for cached blocks
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks (ref count 1), least recently used first; evicts their cached KV."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._cached[old]
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free queue
        (pass a request's blocks tail first, so its chain loses its end before its head)."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    # -- prefix cache --------------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching this hash, if any."""
        return self._cached.get(block_hash)

    def share(self, block: int) -> None:
        """Take one more reference to a cached block (out of the free queue if it was free)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that `block` now holds the full block with this hash (first writer wins)."""
        if block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> bool:
        """Forget every cached hash (a cold cache, for benchmarks); refused (False) while any block is
        in use, since a running request's blocks would lose their hashes mid-flight."""
        if any(self.ref_counts):
            return False
        self._cached.clear()
        self._hash_of.clear()
        return True
