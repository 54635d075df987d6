"""KVManager: per-request block tables over the BlockPool.

Pure Python. A request's table grows a block at a time as its computed tokens need room, and is
returned whole on finish, abort and preemption (tail first, so a later prefix cache loses chain
ends before heads).
"""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: expected a positive integer, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())))

    def allocate(self, request_id: str, num_tokens: int, keep_watermark: bool = False) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (nothing changed) if the pool
        cannot, or would drop below the watermark when `keep_watermark` (used on admission)."""
        need = self.num_new_blocks(request_id, num_tokens)
        reserve = self.watermark_blocks if keep_watermark else 0
        if need + reserve > self.pool.num_free:
            return False
        self.tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.pool.free(table[::-1])

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_allocated_slots(self) -> int:
        return sum(len(t) for t in self.tables.values()) * self.block_size
