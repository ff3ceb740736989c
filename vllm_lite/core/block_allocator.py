"""A pool of physical KV blocks: free list, reference counts, and the prefix-cache index.

Block ids are plain ints in [0, num_blocks). A block is in exactly one of three places:
the free list (no content worth keeping), the evictor (free, but still holds the cached KV
of the hash it is registered under), or in use (ref count >= 1, one count per block table
holding it).
"""

from __future__ import annotations

import logging

from vllm_lite.core.prefix_cache import Evictor
from vllm_lite.errors import InternalError

logger = logging.getLogger(__name__)


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = False, name: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.name = name
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # A stack, lowest id on top: the block freed last is handed out first. Its memory
        # was touched recently (on the CPU: its pages are faulted in, maybe still cached),
        # while a queue walked the whole pool, so every block's pages faulted in once
        # however little of the pool was in use at a time.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictor = Evictor()
        self._cached: dict[bytes, int] = {}

    # -- queries ---------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictor)

    def get_num_total_blocks(self) -> int:
        return self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hash[block_id]

    def free_block_ids(self) -> list[int]:
        """Every free block, cached or not (for invariant checks)."""
        return list(self._free) + list(self._evictor)

    def cached_blocks(self) -> dict[bytes, int]:
        """hash -> block id of every block published in the prefix cache (a copy)."""
        return dict(self._cached)

    # -- allocation ------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with ref count 1: a never-cached one first, else the LRU cached one."""
        if self._free:
            block_id = self._free.pop()
        elif self._evictor:
            block_id = self._evict_one()
        else:
            raise InternalError(f"out of {self.name} blocks")
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] < 1:
            raise InternalError(f"{self.name} block {block_id} is free; claim it with lookup()")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes free (kept in the evictor if cached)."""
        if not 0 <= block_id < self.num_blocks:
            raise InternalError(f"{self.name} block id {block_id} out of range [0, {self.num_blocks})")
        if self._ref_counts[block_id] < 1:
            raise InternalError(f"double free of {self.name} block {block_id}")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._block_hash[block_id] is not None:
                self._evictor.add(block_id)
            else:
                self._free.append(block_id)

    # -- prefix cache ------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """Take a reference on the block cached under ``block_hash``, if any."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._ref_counts[block_id] == 0:
            self._evictor.remove(block_id)
        self._ref_counts[block_id] += 1
        return block_id

    def peek(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, without taking a reference."""
        return self._cached.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Publish an in-use block's (computed) content under its hash.

        Returns False when the hash already names another block (two requests computed the
        same prefix at once): the copy stays private and is freed plainly.
        """
        if not self.enable_caching or block_hash in self._cached:
            return False
        if self._ref_counts[block_id] < 1 or self._block_hash[block_id] is not None:
            raise InternalError(f"cannot register {self.name} block {block_id}")
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no one holds; returns how many were dropped."""
        dropped = 0
        while self._evictor:
            self._free.append(self._evict_one())
            dropped += 1
        return dropped

    def _evict_one(self) -> int:
        block_id = self._evictor.evict()
        # Its content will be overwritten: it no longer stands for that prefix.
        del self._cached[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        return block_id
