"""KVManager: per-request block tables over the BlockPool, and prefix lookup and caching.

Pure Python. A request's table grows a block at a time as its computed tokens need room, and is
returned whole on finish, abort and preemption (tail first, so cached chains lose their ends before
their heads). With prefix caching, a new request's table may start with cached blocks that other
requests computed (shared by reference count), and every block a request fills is hashed and cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.sched.block_hash import chain_hashes
from tokenmill.sched.block_pool import BlockPool


class KVManager:
    def __init__(
        self, num_blocks: int, block_size: int, watermark_blocks: int = 0, enable_prefix_caching: bool = False
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: expected a positive integer, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # request -> hashes of its blocks cached so far

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block's hash; False (nothing done) while requests hold blocks."""
        return self.pool.reset_cache()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())))

    def allocate(self, request_id: str, num_tokens: int, keep_watermark: bool = False) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (nothing changed) if the pool
        cannot, or would drop below the watermark when `keep_watermark` (used on admission)."""
        table = self.tables.get(request_id)
        need = max(0, -(-num_tokens // self.block_size) - (len(table) if table is not None else 0))
        if need + (self.watermark_blocks if keep_watermark else 0) > self.pool.num_free:
            return False
        if table is None:
            table = self.tables[request_id] = []
        if need:  # (a decode step mostly needs none: its block has room)
            table.extend(self.pool.allocate(need))
        return True

    def trim(self, request_id: str, num_tokens: int) -> bool:
        """Give back the blocks of the request's table past those `num_tokens` tokens fill (rejected
        speculative tokens' slots); True if any went."""
        table = self.tables.get(request_id, [])
        keep = self.blocks_for(num_tokens)
        if len(table) <= keep:
            return False
        self.pool.free(table[keep:][::-1])
        del table[keep:]
        return True

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.free(table[::-1])

    # -- prefix cache --------------------------------------------------------------------------

    def find_prefix(self, token_ids: Sequence[int], salt: str | None) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the longest run of leading full blocks of `token_ids`, and their hashes."""
        hashes = chain_hashes(token_ids, self.block_size, salt)
        blocks = self.lookup_prefix(hashes)
        return blocks, hashes[: len(blocks)]

    def lookup_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading `hashes` (a chain) found in the cache."""
        blocks: list[int] = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def adopt_prefix(self, request_id: str, blocks: list[int], hashes: list[bytes]) -> None:
        """Start an empty table with shared cached blocks."""
        assert not self.tables.get(request_id), "a prefix is adopted only by a request holding no blocks"
        for b in blocks:
            self.pool.share(b)
        self.tables[request_id] = list(blocks)
        self._hashes[request_id] = list(hashes)

    def num_hashed_blocks(self, request_id: str) -> int:
        return len(self._hashes.get(request_id, ()))

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], salt: str | None) -> None:
        """Hash and cache the request's blocks that `token_ids` (its computed tokens) now fill."""
        have = self._hashes.get(request_id, [])
        parent = have[-1] if have else None
        bs = self.block_size
        full = len(token_ids) // bs
        self.cache_blocks(request_id, [*have, *chain_hashes(token_ids[len(have) * bs : full * bs], bs, salt, parent)])

    def cache_blocks(self, request_id: str, hashes: Sequence[bytes]) -> None:
        """Cache the request's leading blocks under `hashes` (its chain, from its first block), those not
        cached for it yet."""
        have = self._hashes.setdefault(request_id, [])
        table = self.tables.get(request_id, [])
        for i in range(len(have), len(hashes)):
            self.pool.cache(table[i], hashes[i])
            have.append(hashes[i])

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_allocated_slots(self) -> int:
        return sum(len(t) for t in self.tables.values()) * self.block_size
