"""A stand-in for the model runner that drives a Scheduler step by step.

It keeps a shadow KV cache (which token each GPU/CPU slot holds), applies each step's
swap and copy mappings to it in the documented order, checks that every token a step
attends to reads back right, writes the step's tokens, and samples one token per
sequence (best_of on a group's first sample). The checks here hold on every step of every
simulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq

import torch

from vllm_lite.core.beam_search import BeamCandidate
from vllm_lite.core.scheduler import Scheduler, SchedulerOutput
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.stop_checker import StopChecker
from vllm_lite.layers.sampler import SampleOutput, SamplerOutput
from vllm_lite.layers.sampling_metadata import SamplingMetadata
from vllm_lite.sequence import SequenceGroup
from vllm_lite.worker.model_runner import RunnerOutput

Content = dict[int, list[int | None]]


def record_step(sched: Scheduler, out: SchedulerOutput, sampled: Mapping[int, Seq[int]],
                logprobs: Mapping[int, Seq[float]] | None = None,
                beams: Mapping[str, Seq[BeamCandidate]] | None = None) -> None:
    """Records a step as the engine does (its output processor decides stop rules, forks
    and beams; the scheduler applies them), from plain per-sequence samples. A request whose
    recording fails re-raises here instead of failing alone."""
    outputs = [SampleOutput(seq_id, list(tokens),
                            list(logprobs[seq_id]) if logprobs is not None else [0.0] * len(tokens))
               for seq_id, tokens in sampled.items()]
    result = RunnerOutput(SamplerOutput(outputs, torch.empty(0), {k: list(v) for k, v in (beams or {}).items()}),
                          SamplingMetadata([]))
    failed: dict[str, Exception] = {}
    updates, lane = OutputProcessor(StopChecker(sched.config.max_model_len)).process(
        out, result, failed)
    if failed:
        raise next(iter(failed.values()))
    sched.apply(out, updates, lane)


class FakeModel:
    def __init__(self, scheduler: Scheduler, vocab_size: int = 50) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.cache_config.block_size
        cfg = scheduler.cache_config
        self.gpu: Content = {b: [None] * self.block_size for b in range(cfg.num_gpu_blocks)}
        self.cpu: Content = {b: [None] * self.block_size for b in range(cfg.num_cpu_blocks or 0)}
        self.vocab_size = vocab_size
        self.steps = 0
        self.max_running_seqs = 0

    def next_token(self, seq_id: int, length: int, branch: int) -> int:
        return (seq_id * 31 + length * 7 + branch * 13) % self.vocab_size

    def step(self, abort_before_update: str | None = None) -> SchedulerOutput:
        sched = self.scheduler
        out = sched.schedule()
        self.steps += 1
        self.check_budgets(out)
        for mapping, src, dst in (
            (out.blocks_to_swap_out, self.gpu, self.cpu),
            (out.blocks_to_swap_in, self.cpu, self.gpu),
            (out.blocks_to_copy, self.gpu, self.gpu),
        ):
            for s, d in mapping:
                dst[d] = list(src[s])
        sampled: dict[int, list[int]] = {}
        for sched_group in out.scheduled_seq_groups:
            group = sched_group.seq_group
            first = group.awaiting_first_sample()
            for s in sched_group.seqs:
                tokens = group.get_seq(s.seq_id).get_token_ids()
                table = s.block_table
                end = s.num_computed_tokens + s.num_new_tokens
                assert s.num_new_tokens >= 1 and end <= len(tokens)
                assert len(table) * self.block_size >= end, "slots reserved for every token"
                for pos in range(s.num_computed_tokens):
                    assert self.gpu[table[pos // self.block_size]][pos % self.block_size] == tokens[pos], (
                        f"seq {s.seq_id} reads a wrong KV at position {pos}"
                    )
                for pos in range(s.num_computed_tokens, end):
                    self.gpu[table[pos // self.block_size]][pos % self.block_size] = tokens[pos]
                if s.do_sample:
                    assert end == len(tokens)
                    k = group.sampling_params.best_of if first else 1
                    sampled[s.seq_id] = [self.next_token(s.seq_id, end, b) for b in range(k)]
        if abort_before_update is not None:
            sched.abort_seq_group(abort_before_update)
        record_step(sched, out, sampled, beams=self.beams(out))
        return out

    def beams(self, out: SchedulerOutput) -> dict[str, list[BeamCandidate]]:
        """Beam-search candidates of the step (none: FakeModel samples plain sequences)."""
        return {}

    def check_budgets(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        cfg = sched.config
        assert out.num_batched_tokens == sum(g.token_chunk_size for g in out.scheduled_seq_groups)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        num_scheduled_seqs = sum(len(g.seqs) for g in out.scheduled_seq_groups)
        assert num_scheduled_seqs <= cfg.max_num_seqs
        running = sum(g.get_max_num_running_seqs() for g in sched.running)
        assert running <= cfg.max_num_seqs
        self.max_running_seqs = max(self.max_running_seqs, running)
        if not cfg.enable_chunked_prefill:
            for g in out.scheduled_seq_groups:
                for s in g.seqs:
                    assert s.do_sample, "without chunked prefill a prompt runs whole"
        seen = set()
        for g in out.scheduled_seq_groups:
            assert g.seq_group in sched.running
            for s in g.seqs:
                assert s.seq_id not in seen
                seen.add(s.seq_id)

    def check_drained(self) -> None:
        """Nothing queued, and the whole of both pools free with every count zero."""
        sched = self.scheduler
        bm = sched.block_manager
        assert not sched.waiting and not sched.running and not sched.swapped
        assert not sched.has_unfinished_seqs()
        assert not bm.device_block_tables and not bm.cpu_block_tables
        for allocator in (bm.device_allocator, bm.cpu_allocator):
            n = allocator.get_num_total_blocks()
            assert allocator.get_num_free_blocks() == n
            assert all(allocator.ref_count(b) == 0 for b in range(n))


def run_to_completion(model: FakeModel, max_steps: int = 10_000) -> None:
    while model.scheduler.has_unfinished_seqs():
        assert model.steps < max_steps, "the scheduler stopped making progress"
        model.step()


def first_scheduled_step(model: FakeModel, groups: list[SequenceGroup], max_steps: int = 1000) -> dict[str, int]:
    """Run until every group has been scheduled once; when each was."""
    first: dict[str, int] = {}
    while len(first) < len(groups):
        assert model.steps < max_steps
        out = model.step()
        for g in out.scheduled_seq_groups:
            first.setdefault(g.request_id, out.step)
    return first

