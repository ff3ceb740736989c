"""Targeted scheduler behaviour: policies, aging, preemption victims, chunked prefill,
aborts, stop conditions, bad input. FakeModel checks budgets and KV read-back throughout."""

from __future__ import annotations


import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.scheduler import AppendToken, DropSeq, ForkSeq, GroupUpdate, Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceStatus, next_seq_id

from vllm_lite.errors import InternalError

from .fake_model import FakeModel, first_scheduled_step, record_step, run_to_completion


def make(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 32,
    block_size: int = 4,
    prefix_caching: bool = False,
    **sched_kw,
) -> FakeModel:
    sched_kw.setdefault("max_num_seqs", 8)
    sched_kw.setdefault("max_model_len", 64)
    sched = Scheduler(
        SchedulerConfig(**sched_kw),
        CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=prefix_caching,
            watermark=0.0,
        ),
    )
    return FakeModel(sched)


def params(max_tokens: int = 4, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, **kw)


def test_finished_blocks_free_at_once_and_a_waiting_request_joins_next_step() -> None:
    m = make(max_num_seqs=1)
    sched = m.scheduler
    a = sched.add_request("a", [1, 2, 3, 4, 5], params(2))
    sched.add_request("b", [6, 7], params(1))
    assert [g.request_id for g in m.step().scheduled_seq_groups] == ["a"]
    assert [g.request_id for g in m.step().scheduled_seq_groups] == ["a"]
    assert a.is_finished()
    assert sched.block_manager.get_num_free_device_blocks() == 64  # freed inside update
    assert [g.request_id for g in m.step().scheduled_seq_groups] == ["b"]
    run_to_completion(m)
    m.check_drained()


def test_too_long_prompt_is_ignored_at_once_and_does_not_block() -> None:
    m = make(max_model_len=16, max_num_batched_tokens=64)
    sched = m.scheduler
    long = sched.add_request("long", list(range(17)), params())
    sched.add_request("short", [1, 2], params())
    out = m.step()
    assert out.ignored_seq_groups == [long]
    assert [g.request_id for g in out.scheduled_seq_groups] == ["short"]
    assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in long.get_seqs())
    assert "max_model_len 16" in long.error
    assert sched.get_seq_group("long") is None


def test_prompt_larger_than_the_whole_cache_is_ignored() -> None:
    m = make(num_gpu_blocks=4, max_model_len=64)  # 16 tokens of cache
    sched = m.scheduler
    huge = sched.add_request("huge", list(range(20)), params())
    sched.add_request("ok", [1, 2, 3], params(2))
    out = m.step()
    assert out.ignored_seq_groups == [huge] and "KV blocks" in huge.error
    assert [g.request_id for g in out.scheduled_seq_groups] == ["ok"]
    run_to_completion(m)
    m.check_drained()


@pytest.mark.parametrize(
    "policy, expected",
    [("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"]), ("shortest_first", ["b", "c", "a"])],
)
def test_admission_order_follows_the_policy(policy: str, expected: list[str]) -> None:
    m = make(max_num_seqs=1, scheduling_policy=policy)
    sched = m.scheduler
    # (prompt length, max_tokens, priority): a is long, b is short, c has the top priority.
    for rid, plen, max_tokens, prio in [("a", 10, 5, 1), ("b", 3, 1, 2), ("c", 6, 2, 0)]:
        sched.add_request(rid, [1] * plen, params(max_tokens), priority=prio)
    first = first_scheduled_step(m, [sched.get_seq_group(r) for r in "abc"])
    assert sorted(first, key=first.get) == expected


@pytest.mark.parametrize("policy", ["shortest_first", "priority"])
def test_aging_bounds_the_wait_of_an_unfavoured_request(policy: str) -> None:
    def wait_of_long_request(max_wait_steps: int, horizon: int = 80) -> int | None:
        m = make(max_num_seqs=1, scheduling_policy=policy, max_wait_steps=max_wait_steps)
        sched = m.scheduler
        sched.add_request("long", [1] * 12, params(8), priority=5)
        for step in range(horizon):
            # A steady stream of favoured requests (short, top priority), one per step.
            sched.add_request(f"s{step}", [2, 2], params(2), priority=0)
            out = m.step()
            if any(g.request_id == "long" for g in out.scheduled_seq_groups):
                return step
        return None

    # Without aging the stream starves it; with a bound of 10 steps it waits about that
    # long, plus the one favoured request (2 steps) already running.
    assert wait_of_long_request(max_wait_steps=10**6) is None
    wait = wait_of_long_request(max_wait_steps=10)
    assert wait is not None and 10 <= wait <= 10 + 2


@pytest.mark.parametrize("priorities, victim", [((0, 1, 0), "b"), ((0, 0, 0), "c")])
def test_victim_is_the_lowest_priority_newest_group(priorities, victim: str) -> None:
    # Six blocks, three 2-block prompts: the first decode needs blocks nobody has.
    m = make(num_gpu_blocks=6, block_size=4, scheduling_policy="priority")
    sched = m.scheduler
    for rid, prio in zip("abc", priorities):
        sched.add_request(rid, [3] * 8, params(6), priority=prio)
    assert len(m.step().scheduled_seq_groups) == 3
    out = m.step()
    assert out.num_preempted == 1
    assert victim not in {g.request_id for g in out.scheduled_seq_groups}
    assert sched.get_seq_group(victim) in sched.waiting  # single sequence: recompute
    assert sched.num_preemptions == {"recompute": 1, "swap": 0}
    run_to_completion(m)
    m.check_drained()


def test_swapped_groups_return_before_new_prompts() -> None:
    m = make(num_gpu_blocks=6, block_size=4, preemption_mode="swap")
    sched = m.scheduler
    for rid in "abc":
        sched.add_request(rid, [3] * 8, params(9))
    m.step()
    out = m.step()
    assert out.blocks_to_swap_out and sched.swapped
    newcomer = sched.add_request("new", [1], params(1))
    held_back = 0
    while sched.has_unfinished_seqs():
        out = m.step()
        admitted = any(g.request_id == "new" for g in out.scheduled_seq_groups)
        if sched.swapped:
            assert not admitted, "a new prompt overtook a swapped group"
            if newcomer in sched.waiting and sched.block_manager.get_num_free_device_blocks() >= 1:
                held_back += 1  # it would have fit: only the rule kept it waiting
    assert held_back > 0
    assert newcomer.is_finished()
    m.check_drained()


def test_chunked_prefill_splits_a_long_prompt_and_mixes_decodes() -> None:
    m = make(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    sched = m.scheduler
    sched.add_request("d", [1, 2, 3], params(10))
    m.step()
    long = sched.add_request("p", list(range(20)), params(2))
    chunks = []
    for _ in range(3):
        out = m.step()
        by_id = {g.request_id: g for g in out.scheduled_seq_groups}
        assert by_id["d"].token_chunk_size == 1 and not by_id["d"].is_prompt
        (s,) = by_id["p"].seqs
        chunks.append((s.num_computed_tokens, s.num_new_tokens, s.do_sample))
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    assert long.get_seqs()[0].get_output_len() == 1
    run_to_completion(m)
    m.check_drained()


def test_without_chunking_a_prompt_waits_for_a_whole_step() -> None:
    m = make(max_num_batched_tokens=64, max_model_len=64)
    sched = m.scheduler
    sched.add_request("a", [1] * 60, params(3))
    sched.add_request("b", [1] * 10, params(1))
    out = m.step()
    assert [(g.request_id, g.token_chunk_size) for g in out.scheduled_seq_groups] == [("a", 60)]


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    m = make(num_gpu_blocks=6, block_size=4, preemption_mode="swap")
    sched = m.scheduler
    for rid in "abc":
        sched.add_request(rid, [3] * 8, params(9))
    sched.add_request("w", [1] * 4, params(1))
    m.step()
    m.step()  # c is swapped out, w waits
    assert [g.request_id for g in sched.swapped] == ["c"] and sched.waiting
    sched.abort_seq_group(["c", "w", "no-such-request"])
    assert sched.block_manager.get_num_free_cpu_blocks() == 32
    out = sched.schedule()
    sched.abort_seq_group("a")  # between schedule and update: update skips it
    sampled = {s.seq_id: [1] for g in out.scheduled_seq_groups for s in g.seqs if s.do_sample}
    record_step(sched, out, sampled)
    sched.abort_seq_group("b")
    for rid in "abcw":
        assert sched.get_seq_group(rid) is None
    m.check_drained()


def test_recording_rejects_bad_samples_and_changes_nothing() -> None:
    m = make()
    sched = m.scheduler
    g = sched.add_request("a", [1, 2, 3], params(3, n=2, temperature=1.0))
    out = sched.schedule()
    seq_id = g.get_seqs()[0].seq_id
    # Samples that do not match the step are a runner bug: InternalError, nothing changed.
    for bad in ({}, {seq_id: [5]}, {seq_id: [5, 6, 7]}):
        with pytest.raises(InternalError, match=f"seq {seq_id} must get 2"):
            record_step(sched, out, bad)
        assert g.get_seqs()[0].num_computed_tokens == 0 and g.num_seqs() == 1
    record_step(sched, out, {seq_id: [5, 6]})
    assert g.num_seqs() == 2
    with pytest.raises(InternalError, match="recorded once"):
        record_step(sched, out, {seq_id: [5]})


def test_best_of_forks_at_the_first_sample_sharing_the_prompt() -> None:
    m = make()
    sched = m.scheduler
    g = sched.add_request("a", [1, 2, 3, 4, 5, 6], params(3, n=2, best_of=3, temperature=1.0))
    m.step()
    seqs = g.get_seqs()
    assert len(seqs) == 3
    tables = [sched.block_manager.get_block_table(s) for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    out = m.step()
    # Only the shared, partly filled last block is copied, and only for two of the three.
    assert len(out.blocks_to_copy) == 2 and {src for src, _ in out.blocks_to_copy} == {tables[0][1]}
    run_to_completion(m)
    assert all(s.get_output_len() == 3 for s in g.get_seqs())
    m.check_drained()


def test_stop_conditions() -> None:
    m = make(max_model_len=12, max_num_batched_tokens=64)
    sched = m.scheduler
    eos = sched.add_request("eos", [1], SamplingParams(max_tokens=10), eos_token_id=7)
    ignore = sched.add_request("ignore", [1], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=7)
    min_tok = sched.add_request("min", [1], SamplingParams(max_tokens=10, min_tokens=2), eos_token_id=7)
    stop_id = sched.add_request("stop", [1], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    capped = sched.add_request("cap", [1] * 10, SamplingParams(max_tokens=None))
    for _ in range(4):
        out = sched.schedule()
        sampled: dict[int, list[int]] = {}
        for g in out.scheduled_seq_groups:
            for s in g.seqs:
                sampled[s.seq_id] = [9 if g.request_id == "stop" else 7]
        record_step(sched, out, sampled)
    assert eos.get_seqs()[0].status == SequenceStatus.FINISHED_STOPPED and eos.get_seqs()[0].get_output_len() == 1
    assert ignore.get_seqs()[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED and ignore.get_seqs()[0].get_output_len() == 3
    assert min_tok.get_seqs()[0].status == SequenceStatus.FINISHED_STOPPED and min_tok.get_seqs()[0].get_output_len() == 2
    assert stop_id.get_seqs()[0].status == SequenceStatus.FINISHED_STOPPED and stop_id.get_seqs()[0].stop_reason == 9
    # The model never sees more than max_model_len tokens: 10 + 3 = 13, the last not fed back.
    assert capped.get_seqs()[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert capped.get_seqs()[0].get_len() == 13
    assert not sched.has_unfinished_seqs()


def test_prefix_cache_hits_across_requests_respecting_salt() -> None:
    m = make(prefix_caching=True)
    sched = m.scheduler
    prompt = list(range(12))  # three full blocks
    sched.add_request("first", prompt, params(1))
    run_to_completion(m)
    sched.add_request("again", prompt, params(1))
    sched.add_request("salted", prompt, params(1), cache_salt="tenant-x")
    out = m.step()
    computed = {g.request_id: g.seqs[0].num_computed_tokens for g in out.scheduled_seq_groups}
    assert computed == {"again": 8, "salted": 0}  # the last block is recomputed for its logits
    assert sched.prefix_cache_stats.hits == 2
    run_to_completion(m)
    m.check_drained()


def test_add_request_invariants_are_internal_errors_and_change_nothing() -> None:
    """Requests reach the scheduler admitted (vllm_lite.engine.admission refuses bad input
    with a ValueError: tests/engine/test_llm_hardening.py); one that breaks what admission
    guarantees is a bug upstream, an InternalError, and the queues stay as they were."""
    m = make(max_num_seqs=4)
    sched = m.scheduler
    sched.add_request("a", [1], params())
    cases = [
        (dict(request_id="b", prompt_token_ids=[1], sampling_params=params(n=5, temperature=1.0)), "runs 5 sequences"),
        (dict(request_id="a", prompt_token_ids=[1]), "already in the scheduler"),
        (dict(request_id="b", prompt_token_ids=[]), "prompt_token_ids must be a non-empty"),
        (dict(request_id="b", prompt_token_ids=[1, -2]), "non-negative ints"),
        (dict(request_id="", prompt_token_ids=[1]), "request_id"),
        (dict(request_id="b", prompt_token_ids=[1], priority=1.5), "priority must be an int"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InternalError, match=message):
            sched.add_request(**kwargs)
    assert [g.request_id for g in sched.waiting] == ["a"]
    assert list(sched.requests) == ["a"] and not sched.running and not sched.swapped


def test_apply_finishes_one_sequence_and_then_the_request() -> None:
    """apply(): a finish frees that sequence's blocks at once; the request leaves the
    scheduler when its last sequence ends; an update that does not match the scheduler's
    state is a bug upstream (InternalError) and a step is recorded once."""
    m = make()
    sched = m.scheduler
    g = sched.add_request("a", [1, 2, 3], params(5, n=2, temperature=1.0))
    m.step()
    first, second = g.get_seqs()
    out = sched.schedule()
    free = sched.block_manager.get_num_free_device_blocks()
    sched.apply(out, [GroupUpdate("a", [AppendToken(first.seq_id, 4, 0.0, finish=(
        SequenceStatus.FINISHED_STOPPED, "###"))])])
    assert first.status == SequenceStatus.FINISHED_STOPPED and first.stop_reason == "###"
    assert first.output_token_ids[-1] == 4 and sched.get_seq_group("a") is g
    assert sched.block_manager.get_num_free_device_blocks() > free
    with pytest.raises(InternalError, match="recorded once"):
        sched.apply(out, [])
    out = sched.schedule()
    with pytest.raises(InternalError, match=f"no running seq {first.seq_id}"):
        sched.apply(out, [GroupUpdate("a", [AppendToken(first.seq_id, 4)])])
    out = sched.schedule()
    sched.apply(out, [GroupUpdate("a", [AppendToken(second.seq_id, 5, 0.0, finish=(
        SequenceStatus.FINISHED_LENGTH_CAPPED, None))])])
    assert sched.get_seq_group("a") is None and not sched.has_unfinished_seqs()
    m.check_drained()


def test_apply_forks_before_appending_and_drops_last() -> None:
    """A fork copies its parent as it stood before the step's appends, sharing its blocks;
    a dropped sequence leaves the group with its blocks freed."""
    m = make()
    sched = m.scheduler
    g = sched.add_request("a", [1, 2, 3, 4, 5], params(8))
    m.step()
    (parent,) = g.get_seqs()
    out = sched.schedule()
    child_id = next_seq_id()
    sched.apply(out, [GroupUpdate("a", [AppendToken(parent.seq_id, 11, -0.5),
                                        ForkSeq(parent.seq_id, child_id, 12, -0.25)])])
    child = g.get_seq(child_id)
    assert parent.output_token_ids[-1] == 11 and child.output_token_ids[-1] == 12
    assert child.output_token_ids[:-1] == parent.output_token_ids[:-1]
    assert child.cumulative_logprob - parent.cumulative_logprob == pytest.approx(0.25)
    bm = sched.block_manager
    assert bm.get_block_table(child)[0] == bm.get_block_table(parent)[0]  # shared prompt block
    out = sched.schedule()
    sched.apply(out, [GroupUpdate("a", [DropSeq(parent.seq_id),
                                        AppendToken(child_id, 13)])])
    assert [s.seq_id for s in g.get_seqs()] == [child_id]
    sched.abort_seq_group("a")  # (the fake model never wrote these steps' KV)
    m.check_drained()
