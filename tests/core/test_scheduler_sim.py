"""Randomised scheduler simulations under a tiny KV cache.

Requests arrive at random steps with random prompt lengths (often sharing prefixes),
output lengths, n/best_of and priorities; some are aborted (some between schedule and
update), some can never fit. The cache is small enough that both kinds of preemption
happen. Every step is checked by FakeModel (budgets, KV read-back); at the end every
request has its outcome and both pools are whole again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceGroup, SequenceStatus

from .fake_model import FakeModel

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 24
MAX_MODEL_LEN = 48
SHARED_PREFIXES = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1]]


@dataclass(frozen=True)
class SimCase:
    name: str
    preemption_mode: str | None = None
    policy: str = "fcfs"
    chunked: bool = False
    prefix_caching: bool = False
    num_cpu_blocks: int = 24
    max_num_batched_tokens: int | None = None
    expect_swap: bool = True
    expect_recompute: bool = True


CASES = [
    SimCase("default-fcfs"),
    SimCase("swap-priority-cached", preemption_mode="swap", policy="priority", prefix_caching=True, expect_recompute=False),
    SimCase("recompute-shortest-chunked", preemption_mode="recompute", policy="shortest_first", chunked=True,
            prefix_caching=True, max_num_batched_tokens=12, expect_swap=False),
    SimCase("default-chunked-cached-small-swap", chunked=True, prefix_caching=True, num_cpu_blocks=10,
            max_num_batched_tokens=16),
    SimCase("swap-without-cpu-space-falls-back", preemption_mode="swap", num_cpu_blocks=0, expect_swap=False),
]


def _footprint_ok(prompt_len: int, max_tokens: int, best_of: int, watermark_blocks: int) -> bool:
    # Worst case without sharing, plus the block each sequence may take right after swap-in:
    # what a request must fit in to be sure to finish rather than end with an error.
    per_seq = -(-(prompt_len + max_tokens) // BLOCK_SIZE) + 1
    return best_of * per_seq <= NUM_GPU_BLOCKS - watermark_blocks


def _random_request(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        prompt = rng.choice(SHARED_PREFIXES) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
    else:
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
    best_of = rng.choice([1, 1, 1, 2, 3])
    n = rng.randint(1, best_of)
    return dict(
        prompt=prompt,
        params=SamplingParams(n=n, best_of=best_of, temperature=0.8, max_tokens=rng.randint(1, 16), ignore_eos=True),
        priority=rng.randrange(3),
        salt=rng.choice([None, None, "tenant-b"]),
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_finishes_cleanly(case: SimCase, seed: int) -> None:
    rng = random.Random(seed)
    scheduler_config = SchedulerConfig(
        max_num_seqs=6,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=case.max_num_batched_tokens,
        enable_chunked_prefill=case.chunked,
        scheduling_policy=case.policy,
        preemption_mode=case.preemption_mode,
        max_wait_steps=40,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        num_cpu_blocks=case.num_cpu_blocks,
        enable_prefix_caching=case.prefix_caching,
        watermark=0.05,
    )
    sched = Scheduler(scheduler_config, cache_config)
    model = FakeModel(sched)
    watermark = cache_config.watermark_blocks

    groups: list[SequenceGroup] = []
    expected_ok: dict[str, SequenceGroup] = {}
    expected_ignored: dict[str, SequenceGroup] = {}
    aborted: dict[str, SequenceGroup] = {}
    num_requests = 120
    while len(groups) < num_requests or sched.has_unfinished_seqs():
        assert model.steps < 5000, "the scheduler stopped making progress"
        for _ in range(rng.choice([0, 0, 1, 2, 3]) if len(groups) < num_requests else 0):
            rid = f"req-{len(groups)}"
            if rng.random() < 0.06:
                # Can never run: longer than max_model_len.
                g = sched.add_request(rid, [5] * (MAX_MODEL_LEN + rng.randint(1, 20)))
                expected_ignored[rid] = g
            else:
                r = _random_request(rng)
                g = sched.add_request(rid, r["prompt"], r["params"], priority=r["priority"], cache_salt=r["salt"])
                if _footprint_ok(len(r["prompt"]), r["params"].max_tokens, r["params"].best_of, watermark):
                    expected_ok[rid] = g
            groups.append(g)
        live = [g for g in groups if not g.is_finished() and g.request_id not in expected_ignored]
        victim = None
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            aborted[victim.request_id] = victim
        if victim is not None and rng.random() < 0.5:
            model.step(abort_before_update=victim.request_id)
        else:
            if victim is not None:
                sched.abort_seq_group(victim.request_id)
            model.step()

    model.check_drained()
    assert all(g.is_finished() for g in groups)
    for g in aborted.values():
        assert any(s.status == SequenceStatus.FINISHED_ABORTED for s in g.get_seqs())
    for rid, g in expected_ignored.items():
        assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in g.get_seqs())
        assert "max_model_len" in g.error
    for rid, g in expected_ok.items():
        if rid in aborted:
            continue
        params = g.sampling_params
        assert g.num_seqs() == params.best_of, rid
        for seq in g.get_seqs():
            assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED, (rid, seq)
            assert seq.get_output_len() == params.max_tokens, (rid, seq)
    num_ok = sum(1 for rid in expected_ok if rid not in aborted)
    assert num_ok > num_requests // 2
    # The cache is tiny on purpose: preemption must have happened, of the kinds configured.
    assert (sched.num_preemptions["swap"] > 0) == case.expect_swap
    assert (sched.num_preemptions["recompute"] > 0) == case.expect_recompute
    assert model.max_running_seqs > 1
    if case.prefix_caching:
        assert sched.prefix_cache_stats.hits > 0
