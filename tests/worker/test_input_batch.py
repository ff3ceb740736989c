"""The model runner's incremental step inputs: persistent block-table rows, the one
staging buffer, and prepare_input checked against a plain per-token rebuild on every step
of random scheduler runs (growing tables, copy-on-write forks, preemption by swap and by
recompute, chunked prefill, prefix-cache hits)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import BlockTableRows, StepStaging
from vllm_lite.worker.model_runner import ModelRunner

from core.fake_model import FakeModel


def _gathered(t: BlockTableRows, rows: list[int], width: int) -> np.ndarray:
    out = np.full((len(rows), width), -7, dtype=np.int32)
    t.gather(rows, width, out)
    return out


def test_rows_follow_appends_copy_on_write_and_replacement() -> None:
    t = BlockTableRows(capacity=2, max_blocks=2)
    a = t.row_of(10, [5, 6])
    b = t.row_of(11, [7])
    assert _gathered(t, [a, b], 2).tolist() == [[5, 6], [7, 0]]
    t.end_step()
    # Appended past the width (the rows widen), then a copy-on-write of the last block.
    a = t.row_of(10, [5, 6, 9])
    assert _gathered(t, [a], 3).tolist() == [[5, 6, 9]]
    a = t.row_of(10, [5, 6, 4])
    assert _gathered(t, [a], 3).tolist() == [[5, 6, 4]]
    t.end_step()  # 11 did not run: its row is free again
    # More sequences than rows (the rows grow); a shorter table clears its old tail.
    rows = [t.row_of(s, [s, s + 1]) for s in (20, 21, 22)]
    a = t.row_of(10, [3])
    assert _gathered(t, rows + [a], 3).tolist() == [[20, 21, 0], [21, 22, 0], [22, 23, 0],
                                                    [3, 0, 0]]


def test_a_table_changed_in_place_by_the_caller_is_seen() -> None:
    t = BlockTableRows()
    table = [1, 2]
    row = t.row_of(0, table)
    table.append(3)  # the same list object, grown after the step
    assert _gathered(t, [t.row_of(0, table)], 3).tolist() == [[1, 2, 3]]
    assert row == t.row_of(0, table)


def test_staging_views_share_one_buffer_and_alternate() -> None:
    s = StepStaging(torch.device("cpu"))
    h64, h32 = s.start(3, 5)
    h64[:] = [1, -2, 2**40]
    h32[:] = [7, 8, 9, 10, -11]
    d64, d32 = s.finish()
    assert d64.dtype == torch.int64 and d32.dtype == torch.int32
    assert d64.tolist() == [1, -2, 2**40] and d32.tolist() == [7, 8, 9, 10, -11]
    first = d64.data_ptr()
    h64, h32 = s.start(3, 5)
    h64[:] = 0
    assert d64.tolist() == [1, -2, 2**40], "the previous step's inputs stay intact"
    assert s.finish()[0].data_ptr() != first


def _reference(runner: ModelRunner, out) -> dict[str, list]:
    """The step's inputs rebuilt token by token from the sequences' full token lists."""
    bs = runner.block_size
    ref = {"ids": [], "pos": [], "slots": [], "seq_lens": [], "starts": [0], "tables": [],
           "sample": []}
    width = max(len(s.block_table) for g in out.scheduled_seq_groups for s in g.seqs)
    for g in out.scheduled_seq_groups:
        for s in g.seqs:
            tokens = g.seq_group.get_seq(s.seq_id).get_token_ids()
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                ref["ids"].append(tokens[p])
                ref["pos"].append(p)
                ref["slots"].append(s.block_table[p // bs] * bs + p % bs)
            ref["seq_lens"].append(s.num_computed_tokens + s.num_new_tokens)
            ref["starts"].append(len(ref["ids"]))
            ref["tables"].append(s.block_table + [0] * (width - len(s.block_table)))
            if s.do_sample:
                ref["sample"].append(len(ref["ids"]) - 1)
    return ref


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunked,mode", [(False, "swap"), (True, "recompute")])
def test_prepare_input_matches_a_full_rebuild_every_step(seed: int, chunked: bool,
                                                         mode: str) -> None:
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_model_len=48, enable_chunked_prefill=chunked,
                        max_num_batched_tokens=16 if chunked else None, preemption_mode=mode),
        CacheConfig(block_size=4, num_gpu_blocks=20, num_cpu_blocks=24,
                    enable_prefix_caching=True))
    model = FakeModel(sched)
    runner = ModelRunner(torch.nn.Identity(), 4, torch.device("cpu"))
    schedule = sched.schedule
    checked = {"steps": 0, "decode": 0, "prefill": 0}

    def checking_schedule():
        out = schedule()
        if not out.scheduled_seq_groups:
            return out
        inp = runner.prepare_input(out)
        ref = _reference(runner, out)
        meta = inp.attn_metadata
        assert inp.input_ids.tolist() == ref["ids"]
        assert inp.positions.tolist() == ref["pos"]
        assert meta.slot_mapping.tolist() == ref["slots"]
        assert meta.seq_lens.tolist() == ref["seq_lens"]
        assert meta.query_start_loc.tolist() == ref["starts"]
        assert meta.block_tables.tolist() == ref["tables"]
        assert inp.sample_indices.tolist() == ref["sample"]
        assert meta.max_seq_len == max(ref["seq_lens"])
        assert meta.is_prompt == any(s.is_prompt or s.num_new_tokens > 1
                                     for g in out.scheduled_seq_groups for s in g.seqs)
        checked["steps"] += 1
        checked["prefill" if meta.is_prompt else "decode"] += 1
        return out

    sched.schedule = checking_schedule
    prefix = [rng.randrange(50) for _ in range(8)]
    for i in range(30):
        best_of = rng.choice([1, 1, 2, 3])
        prompt = (prefix if rng.random() < 0.5 else []) + [
            rng.randrange(50) for _ in range(rng.randrange(1, 14))]
        sched.add_request(f"r{i}", prompt, SamplingParams(
            n=rng.randint(1, best_of), best_of=best_of, temperature=0.8,
            max_tokens=rng.randint(1, 20), ignore_eos=True))
        for _ in range(rng.randrange(3)):
            model.step()
    while sched.has_unfinished_seqs():
        model.step()
    assert checked["decode"] > 20 and checked["prefill"] > 5, checked
    assert sched.stats().num_preemptions > 0, "the cache is small enough to preempt"
