"""Block tables of sequences over the GPU and CPU block pools.

Each sequence holding KV has a block table: logical block i of the sequence lives in
physical block table[i]. Tables of a RUNNING sequence point into the GPU pool, those of a
SWAPPED one into the CPU pool. Forked sequences share blocks (ref counts) and copy a shared
block only when about to write into it.

The manager never touches tensors: it returns (src, dst) block-id pairs for the cache
engine's ``swap_blocks`` / ``copy_blocks`` and leaves sequence statuses to the scheduler.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from vllm_lite.config.schema import CacheConfig
from vllm_lite.core.block_allocator import BlockAllocator
from vllm_lite.core.prefix_cache import PrefixCacheStats, extend_block_hashes
from vllm_lite.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm_lite.errors import InternalError

logger = logging.getLogger(__name__)

BlockTable = list[int]
BlockMapping = list[tuple[int, int]]


class AllocStatus(enum.Enum):
    """Whether a group's blocks can be had now, after others free some, or never."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class BlockSpaceManager:
    def __init__(self, cache_config: CacheConfig) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set to build a block manager")
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = cache_config.watermark_blocks
        self.device_allocator = BlockAllocator(
            cache_config.num_gpu_blocks, enable_caching=self.enable_caching, name="device"
        )
        # Swap-in lands in fresh device blocks, so the CPU pool needs no prefix index.
        self.cpu_allocator = BlockAllocator(cache_config.num_cpu_blocks or 0, name="cpu")
        # A device table's list only ever grows in place (allocation, growth); any other
        # change (copy-on-write, swap-in, a new allocation) gives the sequence a new list.
        # So a holder of the list (the scheduler's plain decode hands it out uncopied, the
        # model runner keeps a persistent row of it) sees every change by its identity and
        # length alone, at no cost growing with the context.
        self.device_block_tables: dict[int, BlockTable] = {}
        self.cpu_block_tables: dict[int, BlockTable] = {}
        # Per sequence, how many leading full blocks are already published in the cache.
        self._num_registered: dict[int, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_total_device_blocks(self) -> int:
        return self.device_allocator.get_num_total_blocks()

    @property
    def num_total_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_total_blocks()

    def get_num_free_device_blocks(self) -> int:
        return self.device_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq: Sequence) -> BlockTable:
        table = self.device_block_tables.get(seq.seq_id)
        if table is None:
            raise InternalError(f"seq {seq.seq_id} has no device blocks")
        return list(table)

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.device_block_tables or seq.seq_id in self.cpu_block_tables

    # -- prompt allocation -----------------------------------------------------------------
    def _blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        """Worst case, cache hits aside: what decides whether the group can ever fit."""
        return sum(self._blocks_for(s.get_len()) for s in seq_group.get_seqs(SequenceStatus.WAITING))

    def _free_blocks_consumed(self, seq_group: SequenceGroup) -> int:
        """Free blocks allocate() would take now: hits on blocks in use cost nothing, hits
        in the evictor still take a free block. (Overlapping hits of several sequences are
        counted twice, which only errs on the safe side.)"""
        total = 0
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            in_use = 0
            for block_hash in self._prefix_hashes(seq):
                block_id = self.device_allocator.peek(block_hash)
                if block_id is None:
                    break
                in_use += self.device_allocator.ref_count(block_id) > 0
            total += self._blocks_for(seq.get_len()) - in_use
        return total

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        if self._blocks_to_allocate(seq_group) > self.num_total_device_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_device_blocks() - self._free_blocks_consumed(seq_group) < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give every WAITING sequence of the group a table, reusing cached prefix blocks.

        Sets each sequence's num_computed_tokens to the tokens found in the cache.
        """
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        for seq in seqs:
            if self.has_blocks(seq):
                raise InternalError(f"seq {seq.seq_id} already holds blocks")
        required = self._free_blocks_consumed(seq_group)
        if required > self.get_num_free_device_blocks():
            raise InternalError(
                f"request {seq_group.request_id} needs {required} device blocks, "
                f"{self.get_num_free_device_blocks()} free"
            )
        for seq in seqs:
            table = self._claim_cached_prefix(seq)
            num_hits = len(table)
            table.extend(
                self.device_allocator.allocate() for _ in range(self._blocks_for(seq.get_len()) - num_hits)
            )
            self.device_block_tables[seq.seq_id] = table
            self._num_registered[seq.seq_id] = num_hits
            seq.num_computed_tokens = num_hits * self.block_size

    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks a prefix-cache hit may cover."""
        if not self.enable_caching or not seq.read_prefix_cache:
            return []
        # At least one token must be computed to get the logits of the next one.
        max_hits = (seq.get_len() - 1) // self.block_size
        hashes = extend_block_hashes(
            seq.block_hashes, seq.get_token_ids(), self.block_size, max_hits, seq.cache_salt
        )
        return hashes[:max_hits]

    def _claim_cached_prefix(self, seq: Sequence) -> BlockTable:
        hashes = self._prefix_hashes(seq)
        table: BlockTable = []
        for block_hash in hashes:
            block_id = self.device_allocator.lookup(block_hash)
            if block_id is None:
                break
            table.append(block_id)
        self.prefix_cache_stats.queries += len(hashes)
        self.prefix_cache_stats.hits += len(table)
        return table

    def mark_computed(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks whose KV is now computed in the prefix cache."""
        if not self.enable_caching:
            return
        table = self.device_block_tables.get(seq.seq_id)
        if table is None:
            return
        done = self._num_registered[seq.seq_id]
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        if num_full <= done:
            return
        hashes = extend_block_hashes(
            seq.block_hashes, seq.get_token_ids(), self.block_size, num_full, seq.cache_salt
        )
        for i in range(done, num_full):
            if self.device_allocator.block_hash(table[i]) is None:
                self.device_allocator.register(table[i], hashes[i])
        self._num_registered[seq.seq_id] = num_full

    # -- growth and copy-on-write -----------------------------------------------------------
    def _append_plan(self, seq: Sequence, ref_counts: dict[int, int]) -> tuple[int, list[int]]:
        """(new blocks at the tail, table indices to copy) for seq to hold all its tokens.

        ``ref_counts`` carries the counts as earlier sequences' copies would leave them, so
        a block shared by k sequences of a group is copied k - 1 times, not k.
        """
        table = self.device_block_tables[seq.seq_id]
        num_new = max(0, self._blocks_for(seq.get_len()) - len(table))
        to_copy = []
        ref_count = self.device_allocator.ref_count
        for i in range(seq.num_computed_tokens // self.block_size, len(table)):
            block_id = table[i]
            count = ref_counts.get(block_id)
            if count is None:
                count = ref_count(block_id)
            if count > 1:
                to_copy.append(i)
                ref_counts[block_id] = count - 1
        return num_new, to_copy

    def _running_seqs_with_blocks(self, seq_group: SequenceGroup) -> list[Sequence]:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        for seq in seqs:
            if seq.seq_id not in self.device_block_tables:
                raise InternalError(f"seq {seq.seq_id} is RUNNING but holds no device blocks")
        return seqs

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get slots for its uncomputed tokens."""
        ref_counts: dict[int, int] = {}
        needed = 0
        for seq in self._running_seqs_with_blocks(seq_group):
            num_new, to_copy = self._append_plan(seq, ref_counts)
            needed += num_new + len(to_copy)
        return needed <= self.get_num_free_device_blocks()

    def append_slots(self, seq_group: SequenceGroup) -> BlockMapping:
        """Make room for the uncomputed tokens of every running sequence.

        Returns the copy-on-write (src, dst) pairs for ``copy_blocks``: only the shared
        blocks about to be written are copied, never a whole table.
        """
        copies = self.try_append_slots(seq_group)
        if copies is None:
            raise InternalError(f"not enough free device blocks to grow request {seq_group.request_id}")
        return copies

    def try_append_slots(self, seq_group: SequenceGroup) -> BlockMapping | None:
        """append_slots when the free blocks suffice (its copy pairs), else None and
        nothing changed: can_append_slots and append_slots in one pass."""
        if len(seq_group.seqs_dict) == 1:
            (seq,) = seq_group.seqs_dict.values()
            if seq.status is SequenceStatus.RUNNING:
                table = self.device_block_tables.get(seq.seq_id)
                if table is not None:
                    grown = self._try_grow_alone(seq, table)
                    if grown is not None:
                        return grown
        seqs = self._running_seqs_with_blocks(seq_group)
        # One plan per sequence, the counts carried as the earlier copies leave them: what
        # planning each one after the earlier ones ran would give (those frees included).
        ref_counts: dict[int, int] = {}
        plans = [self._append_plan(seq, ref_counts) for seq in seqs]
        if sum(n + len(c) for n, c in plans) > self.get_num_free_device_blocks():
            return None
        copies: BlockMapping = []
        for seq, (num_new, to_copy) in zip(seqs, plans):
            table = self.device_block_tables[seq.seq_id]
            if to_copy:  # not in place: see device_block_tables
                table = self.device_block_tables[seq.seq_id] = list(table)
            for i in to_copy:
                src = table[i]
                dst = self.device_allocator.allocate()
                self.device_allocator.free(src)
                table[i] = dst
                copies.append((src, dst))
            table.extend(self.device_allocator.allocate() for _ in range(num_new))
        return copies

    def _try_grow_alone(self, seq: Sequence, table: BlockTable) -> BlockMapping | None:
        """try_append_slots for a request's only sequence when no block it writes is shared
        (the usual decode step): new tail blocks only. None: not that case, or no room
        (the general path decides)."""
        bs = self.block_size
        num_new = -(-seq.get_len() // bs) - len(table)
        ref_count = self.device_allocator.ref_count
        for i in range(seq.num_computed_tokens // bs, len(table)):
            if ref_count(table[i]) > 1:
                return None
        if num_new > 0:
            if num_new > self.device_allocator.get_num_free_blocks():
                return None
            allocate = self.device_allocator.allocate
            table.extend(allocate() for _ in range(num_new))
        return []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent."""
        table = self.device_block_tables.get(parent.seq_id)
        if table is None:
            raise InternalError(f"parent seq {parent.seq_id} holds no device blocks")
        if self.has_blocks(child):
            raise InternalError(f"child seq {child.seq_id} already holds blocks")
        for block_id in table:
            self.device_allocator.incref(block_id)
        self.device_block_tables[child.seq_id] = list(table)
        self._num_registered[child.seq_id] = self._num_registered[parent.seq_id]

    # -- swapping ---------------------------------------------------------------------------
    @staticmethod
    def _distinct_blocks(tables: Iterable[BlockTable]) -> int:
        return len({block_id for table in tables for block_id in table})

    def _tables_of(self, seqs: list[Sequence], tables: dict[int, BlockTable], where: str) -> list[BlockTable]:
        missing = [seq.seq_id for seq in seqs if seq.seq_id not in tables]
        if missing:
            raise InternalError(f"seqs {missing} hold no {where} blocks")
        return [tables[seq.seq_id] for seq in seqs]

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        tables = self._tables_of(seqs, self.device_block_tables, "device")
        return self._distinct_blocks(tables) <= self.get_num_free_cpu_blocks()

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        tables = self._tables_of(seqs, self.cpu_block_tables, "CPU")
        # Each sequence may need a block right after it comes back (vLLM's bound); without
        # it a group that cannot grow would bounce between the pools forever.
        required = self._distinct_blocks(tables) + len(seqs)
        if required > self.num_total_device_blocks:
            return AllocStatus.NEVER
        if required > self.get_num_free_device_blocks():
            return AllocStatus.LATER
        return AllocStatus.OK

    def swap_out(self, seq_group: SequenceGroup) -> BlockMapping:
        """Move the group's running sequences to the CPU pool; returns (device, cpu) pairs."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        if not self.can_swap_out(seq_group):
            raise InternalError(f"not enough free CPU blocks to swap out request {seq_group.request_id}")
        mapping = self._move(seqs, self.device_block_tables, self.cpu_block_tables, self.device_allocator, self.cpu_allocator)
        for seq in seqs:
            del self._num_registered[seq.seq_id]
        return mapping

    def swap_in(self, seq_group: SequenceGroup) -> BlockMapping:
        """Bring the group's swapped sequences back; returns (cpu, device) pairs."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        if self.can_swap_in(seq_group) != AllocStatus.OK:
            raise InternalError(f"not enough free device blocks to swap in request {seq_group.request_id}")
        mapping = self._move(seqs, self.cpu_block_tables, self.device_block_tables, self.cpu_allocator, self.device_allocator)
        for seq in seqs:
            # The fresh device blocks are unpublished; mark_computed re-registers them.
            self._num_registered[seq.seq_id] = 0
        return mapping

    @staticmethod
    def _move(
        seqs: list[Sequence],
        src_tables: dict[int, BlockTable],
        dst_tables: dict[int, BlockTable],
        src_alloc: BlockAllocator,
        dst_alloc: BlockAllocator,
    ) -> BlockMapping:
        # A block shared inside the group is moved once and stays shared on the other side.
        mapping: dict[int, int] = {}
        for seq in seqs:
            new_table = []
            for src in src_tables[seq.seq_id]:
                if src in mapping:
                    dst_alloc.incref(mapping[src])
                else:
                    mapping[src] = dst_alloc.allocate()
                new_table.append(mapping[src])
                src_alloc.free(src)
            del src_tables[seq.seq_id]
            dst_tables[seq.seq_id] = new_table
        return list(mapping.items())

    # -- release ------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, wherever they are; a no-op if it holds none."""
        for tables, allocator in (
            (self.device_block_tables, self.device_allocator),
            (self.cpu_block_tables, self.cpu_allocator),
        ):
            table = tables.pop(seq.seq_id, None)
            if table is not None:
                # Tail first, so a cached prefix outlives the blocks that hang from it.
                for block_id in reversed(table):
                    allocator.free(block_id)
        self._num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        return self.device_allocator.reset_prefix_cache()
