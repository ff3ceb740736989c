"""Random allocate / fork / append (copy-on-write) / swap / free / prefix-hit sequences
against the block manager, with the pool's invariants checked after every step.

Besides the bookkeeping (ref counts, free lists), a shadow of the KV cache records which
token each slot holds: the machine "computes" tokens into it, copies and swaps it with the
returned mappings, and checks that every computed position of every live sequence still
reads back its own token. That is what catches a write into a shared block, a wrong
copy-on-write pair, a bad swap mapping or a prefix-cache hit on the wrong content.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_lite.config import CacheConfig
from vllm_lite.core.block_manager import AllocStatus, BlockSpaceManager
from vllm_lite.errors import InternalError
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 14
NUM_CPU_BLOCKS = 10
# Two shared prefixes (two blocks each) so that prompts often start alike.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8], []]

Content = dict[int, list[int | None]]


class BlockManagerMachine(RuleBasedStateMachine):
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockSpaceManager(
            CacheConfig(
                block_size=BLOCK_SIZE,
                num_gpu_blocks=NUM_GPU_BLOCKS,
                num_cpu_blocks=NUM_CPU_BLOCKS,
                enable_prefix_caching=self.enable_caching,
                watermark=0.0,
            )
        )
        self.groups: list[SequenceGroup] = []
        self.gpu: Content = {b: [None] * BLOCK_SIZE for b in range(NUM_GPU_BLOCKS)}
        self.cpu: Content = {b: [None] * BLOCK_SIZE for b in range(NUM_CPU_BLOCKS)}

    # -- helpers ------------------------------------------------------------------------
    def _groups_with(self, status: SequenceStatus) -> list[SequenceGroup]:
        return [g for g in self.groups if g.get_seqs(status)]

    def _new_group(self, prompt: list[int], salt: bytes | None) -> SequenceGroup:
        seq = Sequence(next_seq_id(), prompt, salt)
        return SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams())

    def _copy(self, dst: Content, src: Content, mapping) -> None:
        for s, d in mapping:
            dst[d] = list(src[s])

    def _drop_finished(self, group: SequenceGroup) -> None:
        if group.is_finished():
            self.groups.remove(group)

    # -- rules --------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(0, 3), max_size=7),
        salt=st.sampled_from([None, b"tenant-a"]),
    )
    def allocate(self, prefix: int, tail: list[int], salt: bytes | None) -> None:
        prompt = PREFIXES[prefix] + tail
        if not prompt:
            return
        self._allocate(self._new_group(prompt, salt))

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def allocate_same_prompt(self, data) -> None:
        """A new request with the prompt (and salt) of a live one: the prefix-hit path."""
        seq = data.draw(st.sampled_from(self.groups)).get_seqs()[0]
        self._allocate(self._new_group(seq.prompt_token_ids, seq.cache_salt))

    def _allocate(self, group: SequenceGroup) -> None:
        status = self.bm.can_allocate(group)
        needed = -(-group.get_seqs()[0].get_len() // BLOCK_SIZE)
        if status != AllocStatus.OK:
            assert needed > self.bm.get_num_free_device_blocks() - self.bm.watermark_blocks
            assert (status == AllocStatus.NEVER) == (needed > NUM_GPU_BLOCKS)
            return
        self.bm.allocate(group)
        if group.get_seqs()[0].num_computed_tokens:
            event("prefix-cache hit")
        seq = group.get_seqs()[0]
        assert seq.num_computed_tokens < seq.get_len()
        seq.status = SequenceStatus.RUNNING
        self.groups.append(group)

    @precondition(lambda self: self._groups_with(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def compute(self, data) -> None:
        """A model step: reserve slots (copy-on-write), then write every running
        sequence's uncomputed tokens into them."""
        group = data.draw(st.sampled_from(self._groups_with(SequenceStatus.RUNNING)))
        if not self.bm.can_append_slots(group):
            return
        before = {b: self.bm.device_allocator.ref_count(b) for b in range(NUM_GPU_BLOCKS)}
        copies = self.bm.append_slots(group)
        for src, dst in copies:
            assert before[src] > 1, "only a shared block is copied"
            assert before[dst] == 0, "a copy lands in a block that was free"
        assert len({dst for _, dst in copies}) == len(copies)
        self._copy(self.gpu, self.gpu, copies)
        if copies:
            event("copy-on-write")
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = self.bm.get_block_table(seq)
            tokens = seq.get_token_ids()
            for pos in range(seq.num_computed_tokens, seq.get_len()):
                block = table[pos // BLOCK_SIZE]
                # Writing into a shared or published block would corrupt someone else's KV.
                assert self.bm.device_allocator.ref_count(block) == 1
                assert self.bm.device_allocator.block_hash(block) is None
                self.gpu[block][pos % BLOCK_SIZE] = tokens[pos]
            seq.num_computed_tokens = seq.get_len()
            self.bm.mark_computed(seq)

    @precondition(lambda self: self._groups_with(SequenceStatus.RUNNING))
    @rule(data=st.data(), token=st.integers(0, 3))
    def sample(self, data, token: int) -> None:
        """Every fully computed running sequence of a group gets its next token."""
        group = data.draw(st.sampled_from(self._groups_with(SequenceStatus.RUNNING)))
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.get_num_uncomputed_tokens() == 0:
                seq.append_token_id(token)

    @precondition(lambda self: self._groups_with(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def fork(self, data) -> None:
        group = data.draw(st.sampled_from(self._groups_with(SequenceStatus.RUNNING)))
        parent = data.draw(st.sampled_from(group.get_seqs(SequenceStatus.RUNNING)))
        child = parent.fork(next_seq_id())
        self.bm.fork(parent, child)
        group.add(child)
        assert self.bm.get_block_table(child) == self.bm.get_block_table(parent)

    @precondition(lambda self: self._groups_with(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(st.sampled_from(self._groups_with(SequenceStatus.RUNNING)))
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if not self.bm.can_swap_out(group):
            return
        distinct = {b for s in seqs for b in self.bm.get_block_table(s)}
        mapping = self.bm.swap_out(group)
        assert sorted(src for src, _ in mapping) == sorted(distinct), "each shared block moves once"
        self._copy(self.cpu, self.gpu, mapping)
        event("swap out")
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED

    @precondition(lambda self: self._groups_with(SequenceStatus.SWAPPED))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.sampled_from(self._groups_with(SequenceStatus.SWAPPED)))
        if self.bm.can_swap_in(group) != AllocStatus.OK:
            return
        mapping = self.bm.swap_in(group)
        assert len({dst for _, dst in mapping}) == len(mapping)
        self._copy(self.gpu, self.cpu, mapping)
        event("swap in")
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_seq(self, data) -> None:
        group = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(group.get_unfinished_seqs()))
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED_STOPPED
        self._drop_finished(group)

    @rule(data=st.data())
    def double_free_is_refused(self, data) -> None:
        free_blocks = self.bm.device_allocator.free_block_ids()
        if free_blocks:
            with pytest.raises(InternalError, match="double free"):
                self.bm.device_allocator.free(data.draw(st.sampled_from(free_blocks)))

    # -- invariants -------------------------------------------------------------------------
    def _check_pool(self, allocator, tables: dict[int, list[int]], num_blocks: int) -> None:
        holders = Counter(b for table in tables.values() for b in table)
        for b in range(num_blocks):
            assert allocator.ref_count(b) == holders[b], f"block {b}"
        free = allocator.free_block_ids()
        assert len(free) == len(set(free)), "a block is free twice"
        assert not set(free) & set(holders), "a block is both free and in a table"
        assert len(free) + len(holders) == num_blocks == allocator.get_num_total_blocks()
        assert allocator.get_num_free_blocks() == len(free)

    @invariant()
    def pools_are_consistent(self) -> None:
        self._check_pool(self.bm.device_allocator, self.bm.device_block_tables, NUM_GPU_BLOCKS)
        self._check_pool(self.bm.cpu_allocator, self.bm.cpu_block_tables, NUM_CPU_BLOCKS)
        for block_hash, block in self.bm.device_allocator.cached_blocks().items():
            assert self.bm.device_allocator.block_hash(block) == block_hash
        live = {s.seq_id for g in self.groups for s in g.get_unfinished_seqs()}
        assert set(self.bm.device_block_tables) | set(self.bm.cpu_block_tables) == live

    @invariant()
    def computed_tokens_read_back(self) -> None:
        for group in self.groups:
            for seq in group.get_unfinished_seqs():
                on_gpu = seq.status == SequenceStatus.RUNNING
                table = (self.bm.device_block_tables if on_gpu else self.bm.cpu_block_tables)[seq.seq_id]
                content = self.gpu if on_gpu else self.cpu
                assert len(table) * BLOCK_SIZE >= seq.num_computed_tokens
                tokens = seq.get_token_ids()
                for pos in range(seq.num_computed_tokens):
                    assert content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == tokens[pos]

    def teardown(self) -> None:
        # Everything freed: the whole pool is back and every count is zero.
        for group in self.groups:
            for seq in group.get_unfinished_seqs():
                self.bm.free(seq)
        for allocator, n in ((self.bm.device_allocator, NUM_GPU_BLOCKS), (self.bm.cpu_allocator, NUM_CPU_BLOCKS)):
            assert allocator.get_num_free_blocks() == n
            assert all(allocator.ref_count(b) == 0 for b in range(n))


class BlockManagerNoCachingMachine(BlockManagerMachine):
    enable_caching = False


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestBlockManagerWithPrefixCaching = BlockManagerMachine.TestCase
TestBlockManagerWithPrefixCaching.settings = _SETTINGS
TestBlockManagerWithoutPrefixCaching = BlockManagerNoCachingMachine.TestCase
TestBlockManagerWithoutPrefixCaching.settings = _SETTINGS
