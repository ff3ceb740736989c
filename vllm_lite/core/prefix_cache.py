"""Prefix caching: content hashes of full KV blocks and the evictor of freed cached blocks.

A full block is named by SHA-256 over (parent block's hash, the block's token ids, the
request's salt), so equal hashes mean equal prefixes up to and including that block, and
a salt keeps tenants from reading each other's cache. Python's ``hash()`` is never used:
it is salted per process and collides far too easily to stand for KV content.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

from vllm_lite.errors import InternalError

_EMPTY_PARENT = b"\x00" * 32


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes | None) -> bytes:
    """Chained SHA-256 of one full block."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else _EMPTY_PARENT)
    # Length-prefix the salt so that (salt, tokens) pairs can never run into each other.
    salt = salt or b""
    h.update(struct.pack("<Q", len(salt)))
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    salt: bytes | None,
) -> list[bytes]:
    """Grow ``hashes`` (in place) to cover the first ``num_blocks`` full blocks of token_ids."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes


class Evictor:
    """Free blocks that still hold cached KV, reused least recently freed first.

    Insertion order is the eviction order. The block manager frees a table tail first, so
    within one sequence the deepest (least shareable) blocks go before the prefix they hang
    from.
    """

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        if block_id in self._blocks:
            raise InternalError(f"block {block_id} is already in the evictor")
        self._blocks[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._blocks[block_id]

    def evict(self) -> int:
        block_id, _ = self._blocks.popitem(last=False)
        return block_id

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)


@dataclass
class PrefixCacheStats:
    """Full prompt blocks looked up in the cache, and how many were found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
