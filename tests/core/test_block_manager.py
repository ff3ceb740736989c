from __future__ import annotations

import hashlib

import pytest

from vllm_lite.config import CacheConfig
from vllm_lite.core.block_manager import AllocStatus, BlockSpaceManager
from vllm_lite.core.prefix_cache import hash_block
from vllm_lite.errors import InternalError
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id


def make_bm(num_gpu_blocks: int = 8, num_cpu_blocks: int = 8, block_size: int = 2, **kw) -> BlockSpaceManager:
    kw.setdefault("watermark", 0.0)
    return BlockSpaceManager(
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, **kw)
    )


def make_group(prompt: list[int], block_size: int = 2, salt: bytes | None = None) -> SequenceGroup:
    seq = Sequence(next_seq_id(), prompt, salt)
    return SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams())


def allocate_and_compute(bm: BlockSpaceManager, group: SequenceGroup) -> Sequence:
    bm.allocate(group)
    seq = group.get_seqs()[0]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)
    return seq


def fork(bm: BlockSpaceManager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = parent.fork(next_seq_id())
    bm.fork(parent, child)
    group.add(child)
    return child


def test_freed_blocks_are_handed_out_again_first() -> None:
    # The free list is a stack: a finished request's blocks (memory touched recently) go
    # to the next request, instead of the pool's untouched blocks.
    bm = make_bm(num_gpu_blocks=8)
    first = allocate_and_compute(bm, make_group([1, 2, 3, 4, 5]))  # 3 blocks
    used = bm.get_block_table(first)
    assert used == [0, 1, 2]  # a fresh pool hands out the lowest ids first
    other = allocate_and_compute(bm, make_group([6, 7]))
    assert bm.get_block_table(other) == [3]
    bm.free(first)
    again = allocate_and_compute(bm, make_group([8, 9, 10, 11]))  # 2 blocks
    got = bm.get_block_table(again)
    assert set(got) <= set(used) and len(set(got)) == 2, got
    bm.free(other)
    bm.free(again)
    assert bm.get_num_free_device_blocks() == 8


def test_capacity_answers_now_later_never_with_watermark() -> None:
    bm = make_bm(num_gpu_blocks=10, watermark=0.2)  # 2 blocks held back from prompts
    assert bm.can_allocate(make_group(list(range(17)))) == AllocStatus.NEVER  # 9 blocks > 10 - 2
    assert bm.can_allocate(make_group(list(range(16)))) == AllocStatus.OK
    allocate_and_compute(bm, make_group(list(range(10))))  # 5 blocks, 5 free
    assert bm.can_allocate(make_group(list(range(6)))) == AllocStatus.OK  # 3 + 2 held back
    assert bm.can_allocate(make_group(list(range(7)))) == AllocStatus.LATER
    assert bm.can_allocate(make_group(list(range(16)))) == AllocStatus.LATER


def test_fork_then_append_copies_only_the_shared_last_block() -> None:
    bm = make_bm()
    group = make_group([1, 2, 3])  # blocks: [1, 2] full, [3] partial
    parent = allocate_and_compute(bm, group)
    children = [fork(bm, group, parent) for _ in range(2)]
    shared_full, shared_last = bm.get_block_table(parent)
    assert bm.device_allocator.ref_count(shared_last) == 3
    for i, seq in enumerate([parent, *children]):
        seq.append_token_id(10 + i)
    copies = bm.append_slots(group)
    # Three writers of one block: two copies, the last writer keeps the original.
    assert len(copies) == 2 and all(src == shared_last for src, _ in copies)
    tables = [bm.get_block_table(s) for s in (parent, *children)]
    assert all(t[0] == shared_full for t in tables)
    assert len({t[1] for t in tables}) == 3
    assert bm.device_allocator.ref_count(shared_full) == 3
    assert bm.device_allocator.ref_count(shared_last) == 1


def test_a_table_list_only_grows_in_place_and_is_replaced_otherwise() -> None:
    """The invariant the runner's persistent rows rely on: growth extends the sequence's
    own list; a copy-on-write gives it a new one, the old list left as it was."""
    bm = make_bm()
    group = make_group([1, 2, 3])
    parent = allocate_and_compute(bm, group)
    live = bm.device_block_tables[parent.seq_id]
    before = list(live)
    parent.append_token_id(4)
    parent.num_computed_tokens = 3
    assert bm.append_slots(group) == []
    assert bm.device_block_tables[parent.seq_id] is live and live == before
    parent.append_token_id(5)
    parent.num_computed_tokens = 4
    assert bm.append_slots(group) == []
    assert bm.device_block_tables[parent.seq_id] is live and live[:2] == before
    assert len(live) == 3
    child = fork(bm, group, parent)
    grown = list(live)
    for i, seq in enumerate((parent, child)):
        seq.num_computed_tokens = 5
        seq.append_token_id(10 + i)
    copies = bm.append_slots(group)
    assert len(copies) == 1
    tables = [bm.device_block_tables[s.seq_id] for s in (parent, child)]
    assert live == grown, "the list handed out before the copy-on-write is unchanged"
    for table in tables:
        if table[2] != grown[2]:
            assert table is not live


def test_append_allocates_a_block_when_the_last_is_full() -> None:
    bm = make_bm()
    group = make_group([1, 2])
    seq = allocate_and_compute(bm, group)
    seq.append_token_id(3)
    assert bm.can_append_slots(group)
    assert bm.append_slots(group) == []
    assert len(bm.get_block_table(seq)) == 2


def test_swap_moves_a_shared_block_once_and_back() -> None:
    bm = make_bm(num_gpu_blocks=8, num_cpu_blocks=3)
    group = make_group([1, 2, 3, 4, 5])  # 3 blocks
    parent = allocate_and_compute(bm, group)
    child = fork(bm, group, parent)
    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert len(out) == 3  # three distinct blocks, though two tables hold them
    for seq in (parent, child):
        seq.status = SequenceStatus.SWAPPED
    assert bm.get_num_free_device_blocks() == 8 and bm.get_num_free_cpu_blocks() == 0
    assert bm.cpu_block_tables[parent.seq_id] == bm.cpu_block_tables[child.seq_id]
    assert bm.can_swap_in(group) == AllocStatus.OK  # 3 blocks + 1 per sequence of headroom
    back = bm.swap_in(group)
    assert {cpu for cpu, _ in back} == {cpu for _, cpu in out}
    assert bm.get_block_table(parent) == bm.get_block_table(child)
    assert bm.get_num_free_cpu_blocks() == 3


def test_swap_in_never_when_the_group_cannot_grow_on_the_device() -> None:
    bm = make_bm(num_gpu_blocks=4, num_cpu_blocks=8)
    group = make_group([1] * 8)  # the whole GPU pool
    seq = allocate_and_compute(bm, group)
    bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group) == AllocStatus.NEVER


def test_prefix_cache_reuses_computed_blocks_and_counts_hits() -> None:
    bm = make_bm(enable_prefix_caching=True)
    first = allocate_and_compute(bm, make_group([1, 2, 3, 4, 5]))
    second = make_group([1, 2, 3, 4, 9])
    bm.allocate(second)
    seq = second.get_seqs()[0]
    assert seq.num_computed_tokens == 4
    assert bm.get_block_table(seq)[:2] == bm.get_block_table(first)[:2]
    assert bm.get_block_table(seq)[2] != bm.get_block_table(first)[2]
    # Two full blocks looked up per prompt; the first prompt found none.
    assert (bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits) == (4, 2)
    assert bm.prefix_cache_stats.hit_rate == 0.5


def test_prefix_cache_keeps_one_token_to_compute() -> None:
    bm = make_bm(enable_prefix_caching=True)
    allocate_and_compute(bm, make_group([1, 2, 3, 4]))
    again = make_group([1, 2, 3, 4])
    bm.allocate(again)
    assert again.get_seqs()[0].num_computed_tokens == 2  # the last block is recomputed for its logits


def test_salt_keeps_tenants_apart() -> None:
    bm = make_bm(enable_prefix_caching=True)
    allocate_and_compute(bm, make_group([1, 2, 3, 4, 5], salt=b"a"))
    other = make_group([1, 2, 3, 4, 5], salt=b"b")
    bm.allocate(other)
    assert other.get_seqs()[0].num_computed_tokens == 0
    same = make_group([1, 2, 3, 4, 5], salt=b"a")
    bm.allocate(same)
    assert same.get_seqs()[0].num_computed_tokens == 4


def test_uncomputed_blocks_are_not_shared() -> None:
    bm = make_bm(enable_prefix_caching=True)
    bm.allocate(make_group([1, 2, 3, 4, 5]))  # allocated, prefill not run yet
    second = make_group([1, 2, 3, 4, 5])
    bm.allocate(second)
    assert second.get_seqs()[0].num_computed_tokens == 0


def test_evictor_reuses_lru_tail_first_and_drops_the_old_hash() -> None:
    bm = make_bm(num_gpu_blocks=4, enable_prefix_caching=True)
    seq = allocate_and_compute(bm, make_group([1, 2, 3, 4, 5]))
    head, tail, partial = bm.get_block_table(seq)
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 4
    assert set(bm.device_allocator.cached_blocks().values()) == {head, tail}
    # Needs 3 blocks: the two never-cached ones, then the LRU cached one, the tail.
    other = allocate_and_compute(bm, make_group([7, 7, 7, 7, 7, 7]))
    assert tail in bm.get_block_table(other) and head not in bm.get_block_table(other)
    assert set(bm.device_allocator.cached_blocks().values()) >= {head}
    assert bm.device_allocator.block_hash(tail) != hash_block(hash_block(None, [1, 2], None), [3, 4], None)
    bm.free(other)
    again = make_group([1, 2, 3, 4, 5])
    bm.allocate(again)
    assert again.get_seqs()[0].num_computed_tokens == 2  # only the head survived


def test_block_hash_is_chained_sha256() -> None:
    h1 = hash_block(None, [1, 2], None)
    assert len(h1) == 32 and h1 == hash_block(None, [1, 2], None)
    assert hash_block(h1, [3, 4], None) != hash_block(hash_block(None, [9, 9], None), [3, 4], None)
    assert hash_block(None, [1, 2], b"s") != h1
    assert h1 != hashlib.sha256(b"").digest()


def test_broken_invariants_change_nothing() -> None:
    # Misuse from inside the engine is a bug: InternalError (a 500), never a ValueError.
    bm = make_bm(num_gpu_blocks=2)
    group = make_group([1] * 6)
    with pytest.raises(InternalError, match="needs 3 device blocks, 2 free"):
        bm.allocate(group)
    assert bm.get_num_free_device_blocks() == 2 and not bm.device_block_tables
    small = make_group([1, 2])
    seq = allocate_and_compute(bm, small)
    with pytest.raises(InternalError, match="already holds blocks"):
        bm.fork(seq, seq)
    free_block = bm.device_allocator.free_block_ids()[0]
    with pytest.raises(InternalError, match="double free"):
        bm.device_allocator.free(free_block)
    assert bm.get_num_free_device_blocks() == 1
    bm.free(seq)
    bm.free(seq)  # freeing a sequence without blocks is a no-op
    assert bm.get_num_free_device_blocks() == 2


def test_requires_num_gpu_blocks() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockSpaceManager(CacheConfig())
