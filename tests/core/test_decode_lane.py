"""The scheduler's decode lane (plain decodes as columns) against the per-request path.

Two schedulers run the same randomised workload in lockstep under a tiny KV cache, one
with the lane and one with it switched off: every step must schedule the same work (the
same tokens of the same requests, the same block tables, swaps and copies) and every
request must end the same. FakeModel checks each step's KV read-back, lane rows included.
"""

from __future__ import annotations

import random

import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.scheduler import Scheduler, SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceGroup

from .fake_model import FakeModel

BLOCK_SIZE = 4


class _ContentModel(FakeModel):
    """Tokens from the position and branch only: the same in both schedulers, whatever
    their sequence ids."""

    def next_token(self, seq_id: int, length: int, branch: int) -> int:
        return (length * 7 + branch * 13 + 3) % self.vocab_size


def _scheduler(lane: bool, mode: str | None, caching: bool, chunked: bool) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_model_len=40, preemption_mode=mode,
                        enable_chunked_prefill=chunked,
                        max_num_batched_tokens=12 if chunked else None),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=20, num_cpu_blocks=20,
                    enable_prefix_caching=caching, watermark=0.05))
    sched._decode_lane = lane
    return sched


def _view(out: SchedulerOutput) -> list[tuple]:
    """The step's work with sequences named by (request, index in the request)."""
    return sorted(((g.request_id, list(g.seq_group.seqs_dict).index(s.seq_id)),
                   s.num_computed_tokens, s.num_new_tokens, tuple(s.block_table),
                   s.is_prompt, s.do_sample)
                  for g in out.scheduled_seq_groups for s in g.seqs)


def _ending(group: SequenceGroup) -> list[tuple]:
    return [(s.status, tuple(s.output_token_ids), s.num_computed_tokens)
            for s in group.seqs_dict.values()]


@pytest.mark.parametrize("mode,caching,chunked", [
    ("recompute", True, False), ("swap", False, True), (None, True, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_lane_schedules_what_the_per_request_path_does(mode: str | None, caching: bool,
                                                       chunked: bool, seed: int) -> None:
    rng = random.Random(seed)
    runs = [_scheduler(lane, mode, caching, chunked) for lane in (True, False)]
    models = [_ContentModel(s) for s in runs]
    groups: list[list[SequenceGroup]] = [[], []]
    lane_rows = mixed_steps = 0
    for step in range(400):
        if step < 150:
            for _ in range(rng.choice([0, 0, 1, 2])):
                rid = f"r{len(groups[0])}"
                prompt = ([7] * 8 if rng.random() < 0.5 else []) + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 12))]
                best_of = rng.choice([1, 1, 1, 2])
                params = SamplingParams(n=1, best_of=best_of, temperature=0.8,
                                        max_tokens=rng.randint(1, 20), ignore_eos=True,
                                        use_beam_search=False)
                priority = rng.randrange(2)
                for run, gs in zip(runs, groups):
                    gs.append(run.add_request(rid, prompt, params, priority=priority))
        abort = None
        live = [g.request_id for g in groups[0] if not g.is_finished()]
        if live and rng.random() < 0.05:
            abort = rng.choice(live)
        before = rng.random() < 0.5
        views = []
        for run, model in zip(runs, models):
            if abort is not None and before:
                run.abort_seq_group(abort)
            out = model.step(abort_before_update=abort if not before else None) \
                if run.has_unfinished_seqs() else None
            views.append(None if out is None else (
                _view(out), out.blocks_to_swap_in, out.blocks_to_swap_out,
                out.blocks_to_copy, out.num_preempted, out.num_batched_tokens))
            if out is not None and run._decode_lane and out.lane is not None:
                lane_rows += len(out.lane)
                mixed_steps += bool(out.groups)
        assert views[0] == views[1], f"step {step}"
        if step >= 150 and not any(r.has_unfinished_seqs() for r in runs):
            break
    for model in models:
        model.check_drained()
    for a, b in zip(*groups):
        assert _ending(a) == _ending(b), a.request_id
    assert runs[0].num_preemptions == runs[1].num_preemptions
    assert sum(runs[0].num_preemptions.values()) > 0
    assert lane_rows > 100 and mixed_steps > 10
    if caching:
        assert runs[0].prefix_cache_stats.hits == runs[1].prefix_cache_stats.hits > 0


def test_lane_off_puts_every_request_on_the_per_request_path() -> None:
    sched = _scheduler(False, None, False, False)
    model = _ContentModel(sched)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    while sched.has_unfinished_seqs():
        out = model.step()
        assert out.lane is None and out.groups
