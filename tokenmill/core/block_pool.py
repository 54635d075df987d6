"""BlockPool: the fixed set of KV cache blocks, their reference counts and the free list.

Pure Python. A block is an index into the paged K/V tensors; the pool never touches tensors. Blocks
are handed out from the head of the free list and returned to its tail, so the order of reuse is
deterministic (tests assert exact ids).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks (ref count 1). Raises if fewer are free: callers check first."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free list."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
