"""Beam search in the scheduler: the step policy (core/beam_search.py) rule by rule, and
whole beam searches driven through Scheduler.update by a toy model (FakeModel checks every
KV read-back across forks, copy-on-write, swaps and recomputes) against a brute-force
beam search over the same toy model, under tiny caches, swap and recompute preemption,
chunked prefill and prefix caching."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.beam_search import (
    BeamCandidate, Hypothesis, ScoredCandidate, beam_score, select_beams)
from vllm_lite.core.scheduler import Scheduler, SchedulerOutput, _StepState
from vllm_lite.layers.sampler import beam_search_candidates
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceStatus

from vllm_lite.errors import InternalError

from .fake_model import FakeModel, record_step, run_to_completion

STOP = (SequenceStatus.FINISHED_STOPPED, None)


def _beam_params(width: int = 2, n: int | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 6)
    return SamplingParams(n=n or width, best_of=width, use_beam_search=True, temperature=0.0, **kw)


def _cand(parent: int, token: int, cum: float, out_len: int, finish: Any = None) -> ScoredCandidate:
    return ScoredCandidate(BeamCandidate(parent, token, 0.0), cum, out_len, finish)


# ----------------------------------------------------------------------------------------
# The policy
# ----------------------------------------------------------------------------------------


def test_only_top_width_candidates_may_finish() -> None:
    cands = [_cand(0, 1, -1.0, 3), _cand(0, 2, -1.5, 3), _cand(1, 0, -2.0, 3, STOP),
             _cand(1, 3, -2.5, 3)]
    d = select_beams(cands, [], _beam_params(2), max_output_len=10)
    assert d.new_hypotheses == [] and not d.done
    assert [c.candidate.token_id for c in d.continue_] == [1, 2]
    cands[1] = _cand(0, 0, -1.5, 3, STOP)  # EOS ranked second: a hypothesis
    d = select_beams(cands, [], _beam_params(2), max_output_len=10)
    assert [c.candidate.token_id for c in d.new_hypotheses] == [0]
    assert [c.candidate.token_id for c in d.continue_] == [1, 3]


def test_hypotheses_compete_by_length_penalised_score() -> None:
    # Old hypotheses: scores -4/2 = -2 and -9/3 = -3 under length_penalty 1.
    old = [Hypothesis(10, -4.0, 2), Hypothesis(11, -9.0, 3)]
    cands = [_cand(0, 0, -5.0, 4, STOP), _cand(0, 5, -6.0, 4)]  # new one: -1.25
    d = select_beams(cands, old, _beam_params(2), max_output_len=10)
    assert [c.candidate.token_id for c in d.new_hypotheses] == [0]
    assert d.dropped_hypotheses == [11]
    # length_penalty 0 ranks by cumulative logprob: -4 and -5 stay, -9 goes.
    d = select_beams(cands, old, _beam_params(2, length_penalty=0.0), max_output_len=10)
    assert d.dropped_hypotheses == [11] and len(d.new_hypotheses) == 1
    # Negative penalty favours short: -4 * 2 ** 0.5 = -5.66, -9 * 3 ** 0.5 = -15.6, -5 * 2 = -10.
    d = select_beams(cands, old, _beam_params(2, length_penalty=-0.5), max_output_len=10)
    assert d.dropped_hypotheses == [11]
    assert beam_score(-5.0, 4, -0.5) == pytest.approx(-10.0)


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_early_stopping_rules(early_stopping: Any) -> None:
    full = [Hypothesis(10, -4.0, 4), Hypothesis(11, -6.0, 4)]  # scores -1, -1.5 (lp 1)
    # Best running beam: cum -7 over 5 tokens = -1.4 > -1.5, could still improve.
    cands = [_cand(0, 1, -7.0, 5), _cand(0, 2, -8.0, 5)]
    p = _beam_params(2, early_stopping=early_stopping)
    d = select_beams(cands, full, p, max_output_len=10)
    assert d.done == (early_stopping is True)
    # -8 / 5 = -1.6 <= -1.5: no running beam can beat the worst hypothesis at this length...
    cands = [_cand(0, 1, -8.0, 5), _cand(0, 2, -9.0, 5)]
    d = select_beams(cands, full, p, max_output_len=10)
    # ... but "never" with a positive penalty bounds it at max_output_len: -8 / 10 = -0.8.
    assert d.done == (early_stopping != "never")
    d = select_beams(cands, full, _beam_params(2, early_stopping="never", length_penalty=-1.0),
                     max_output_len=10)
    assert d.done  # with lp <= 0 "never" uses the current length, as False
    # Too few hypotheses: never done while beams run; nothing running: done.
    assert not select_beams(cands, full[:1], p, max_output_len=10).done
    assert select_beams([_cand(0, 0, -1.0, 5, STOP)], [], p, max_output_len=10).done


# ----------------------------------------------------------------------------------------
# Whole searches through the scheduler
# ----------------------------------------------------------------------------------------

VOCAB = 12
EOS = 0


def toy_logprobs(tokens: list[int]) -> torch.Tensor:
    """A deterministic next-token distribution for a context (float32 [VOCAB])."""
    seed = zlib.crc32(bytes(str(tokens), "ascii"))
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 1.5, dim=-1)


def reference_beam_search(prompt: list[int], p: SamplingParams, max_model_len: int,
                          eos: int | None = EOS) -> list[list[int]]:
    """Brute force, as HF's beam search: 2W candidates, EOS only within the top W, best
    W hypotheses by cum / len ** lp, the early-stopping heuristics; the n best, best first."""
    width, lp, es = p.best_of, p.length_penalty, p.early_stopping
    max_out = min(p.max_tokens, max_model_len + 1 - len(prompt))
    running: list[tuple[float, list[int]]] = [(0.0, [])]
    hyps: list[tuple[float, list[int]]] = []
    while True:
        cands = []
        for b, (cum, toks) in enumerate(running):
            row = toy_logprobs(prompt + toks).tolist()
            cands += [(cum + row[t], b, t, toks + [t]) for t in range(VOCAB)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        nxt = []
        for rank, (cum, _, t, toks) in enumerate(cands[: 2 * width]):
            if t == eos or len(toks) >= max_out:
                if rank < width:
                    hyps.append((cum / len(toks) ** lp, toks))
            else:
                nxt.append((cum, toks))
        hyps = sorted(hyps, key=lambda h: -h[0])[:width]
        running = nxt[:width]
        if not running:
            break
        if len(hyps) >= width:
            if es is True:
                break
            length = max_out if es == "never" and lp > 0 else len(running[0][1])
            if hyps[-1][0] >= running[0][0] / length ** lp:
                break
    return [toks for _, toks in hyps[: p.n]]


class BeamFakeModel(FakeModel):
    """FakeModel whose beam groups get their candidates from toy_logprobs."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler, vocab_size=VOCAB)
        # (live beams, preemption mode) of every preemption.
        self.preempted: list[tuple[int, str]] = []
        preempt = scheduler._preempt

        def recording(group: Any, state: Any) -> None:
            before = dict(scheduler.num_preemptions)
            live = len(group.get_unfinished_seqs())
            preempt(group, state)
            mode = next(m for m, k in scheduler.num_preemptions.items() if k > before[m])
            self.preempted.append((live, mode))

        scheduler._preempt = recording

    def beams(self, out: SchedulerOutput) -> dict[str, list[BeamCandidate]]:
        result = {}
        for sched_group in out.scheduled_seq_groups:
            group = sched_group.seq_group
            sampled = [group.get_seq(s.seq_id) for s in sched_group.seqs if s.do_sample]
            if not group.sampling_params.use_beam_search or not sampled:
                continue
            # A beam step ranks all live beams together: they sample in one step.
            assert {s.seq_id for s in sampled} == {s.seq_id for s in group.get_unfinished_seqs()}
            rows = torch.stack([toy_logprobs(s.get_token_ids()) for s in sampled])
            cands = beam_search_candidates(rows, [s.cumulative_logprob for s in sampled],
                                           group.sampling_params.best_of)
            result[group.request_id] = [
                BeamCandidate(sampled[b].seq_id, t, float(rows[b, t])) for b, t, _ in cands]
        return result

    def check_budgets(self, out: SchedulerOutput) -> None:
        if not self.scheduler.config.enable_chunked_prefill:
            # Without chunked prefill a sequence's tokens still come in one piece, but
            # recomputed beams hold back their last token to decode it with their group.
            beam_groups = [g for g in out.scheduled_seq_groups
                           if g.seq_group.sampling_params.use_beam_search]
            for g in beam_groups:
                for s in g.seqs:
                    end = s.num_computed_tokens + s.num_new_tokens
                    assert s.do_sample or end == g.seq_group.get_seq(s.seq_id).get_len() - 1
            assert out.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
            rest = [g for g in out.scheduled_seq_groups if g not in beam_groups]
            out = out.only({g.request_id for g in rest})
        super().check_budgets(out)



def _make(num_gpu_blocks: int = 64, num_cpu_blocks: int = 64, prefix_caching: bool = False,
          **sched_kw: Any) -> BeamFakeModel:
    sched_kw.setdefault("max_num_seqs", 12)
    sched_kw.setdefault("max_model_len", 32)
    return BeamFakeModel(Scheduler(
        SchedulerConfig(**sched_kw),
        CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                    enable_prefix_caching=prefix_caching, watermark=0.0)))


PROMPTS = [[3, 5], [1, 2, 3, 4, 5], [7, 1, 7, 1, 7, 1, 7, 1, 9], [2] * 14]
SEARCH_PARAMS = [
    _beam_params(3, length_penalty=1.0, max_tokens=7),
    _beam_params(2, 1, length_penalty=0.5, early_stopping=True, max_tokens=8),
    _beam_params(3, 2, length_penalty=1.5, early_stopping="never", max_tokens=6),
    _beam_params(4, 4, length_penalty=-0.5, max_tokens=9),
]
SCHEDULES = {
    "roomy": dict(),
    "swap": dict(num_gpu_blocks=14),
    "recompute": dict(num_gpu_blocks=16, preemption_mode="recompute"),
    "recompute_chunked": dict(num_gpu_blocks=16, preemption_mode="recompute",
                              enable_chunked_prefill=True, max_num_batched_tokens=12),
    "recompute_prefix_cache": dict(num_gpu_blocks=16, preemption_mode="recompute",
                                   prefix_caching=True),
    "max_num_seqs_4": dict(max_num_seqs=4),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_beam_searches_through_the_scheduler_match_brute_force(schedule: str) -> None:
    kw = dict(SCHEDULES[schedule])
    m = _make(**kw)
    sched = m.scheduler
    groups = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, SEARCH_PARAMS)):
        groups.append(sched.add_request(f"b{i}", prompt, p, eos_token_id=EOS))
    # A plain request rides along.
    plain = sched.add_request("g", [4, 4, 4], SamplingParams(temperature=0.0, max_tokens=5,
                                                             ignore_eos=True))
    run_to_completion(m)
    m.check_drained()
    for prompt, p, group in zip(PROMPTS, SEARCH_PARAMS, groups):
        want = reference_beam_search(prompt, p, sched.config.max_model_len)
        lp = p.length_penalty
        ranked = sorted(group.get_seqs(),
                        key=lambda s: beam_score(s.cumulative_logprob, s.get_output_len(), lp),
                        reverse=True)
        assert group.is_finished() and len(group.get_seqs()) <= p.best_of
        assert [s.output_token_ids for s in ranked[: p.n]] == want
        for s in group.get_seqs():
            ended_on_eos = s.output_token_ids[-1] == EOS
            assert s.status == (SequenceStatus.FINISHED_STOPPED if ended_on_eos
                                else SequenceStatus.FINISHED_LENGTH_CAPPED)
            assert EOS not in s.output_token_ids[:-1]
    assert plain.is_finished() and plain.get_seqs()[0].get_output_len() == 5
    hits_eos = sum(s.output_token_ids[-1] == EOS for g in groups for s in g.get_seqs())
    assert hits_eos > 0
    assert not any(g.error for g in groups)
    if schedule != "roomy" and schedule != "max_num_seqs_4":
        # A group of several live beams was preempted in the schedule's mode.
        mode = kw.get("preemption_mode", "swap")
        assert any(k > 1 and md == mode for k, md in m.preempted), m.preempted


@pytest.mark.parametrize("chunked", [False, True])
def test_recomputed_beams_hold_back_their_last_token(chunked: bool) -> None:
    """Every beam of a group preempted by recompute rebuilds its KV, all but the last
    token first; the beams then decode together and the search ends as if never stopped."""
    kw: dict[str, Any] = dict(enable_chunked_prefill=True, max_num_batched_tokens=4) if chunked else {}
    m = _make(num_gpu_blocks=40, preemption_mode="recompute", max_num_seqs=4, **kw)
    sched = m.scheduler
    prompt, p = [1, 2, 3, 4, 5, 6], _beam_params(3, max_tokens=12)
    group = sched.add_request("b", prompt, p, eos_token_id=None)
    held_back = 0
    while sched.has_unfinished_seqs():
        if m.steps == 6:
            assert len(group.get_unfinished_seqs()) == 3
            sched._preempt(group, _StepState(token_budget=0))
            assert all(s.status == SequenceStatus.WAITING and s.num_computed_tokens == 0
                       for s in group.get_unfinished_seqs())
        lengths = {s.seq_id: s.get_len() for s in group.get_seqs()}
        out = m.step()
        held_back += sum(1 for sg in out.scheduled_seq_groups for s in sg.seqs
                         if not s.do_sample and s.num_computed_tokens + s.num_new_tokens == lengths[s.seq_id] - 1)
    m.check_drained()
    assert held_back >= 3
    ranked = sorted(group.get_seqs(), key=lambda s: beam_score(s.cumulative_logprob, s.get_output_len(), 1.0),
                    reverse=True)
    assert [s.output_token_ids for s in ranked] == reference_beam_search(prompt, p, 32, eos=None)


def test_swapped_in_beams_wait_whole_for_budget() -> None:
    """A beam group swapped back in when fewer tokens are left than it has beams runs
    none of them that step (a beam step needs every beam's logits), and all on the next."""
    m = _make(num_gpu_blocks=40, enable_chunked_prefill=True, max_num_batched_tokens=4,
              max_num_seqs=4)
    sched = m.scheduler
    prompt, p = [1, 2, 3, 4, 5, 6], _beam_params(3, max_tokens=10)
    group = sched.add_request("b", prompt, p, eos_token_id=None)
    while len(group.get_unfinished_seqs()) < 3:
        m.step()
    # An 11-token prompt gets 1 token next to the beams' 3, then chunks of 4, 4, 2 while
    # the beams sit swapped out: 2 tokens are left when they come back.
    sched.add_request("long", list(range(1, 12)), SamplingParams(temperature=0.0, max_tokens=3))
    out = m.step()
    assert [g.token_chunk_size for g in out.scheduled_seq_groups] == [3, 1]
    state = _StepState(token_budget=0)
    sched._preempt(group, state)
    for src, dst in state.swap_out:  # what the cache engine would do
        m.cpu[dst] = list(m.gpu[src])
    waited = False
    while sched.has_unfinished_seqs():
        out = m.step()
        ran = {g.request_id for g in out.scheduled_seq_groups}
        if out.blocks_to_swap_in and "b" not in ran:
            assert out.num_batched_tokens == 2 and len(group.get_unfinished_seqs()) == 3
            waited = True
    m.check_drained()
    assert waited
    ranked = sorted(group.get_seqs(), key=lambda s: beam_score(s.cumulative_logprob, s.get_output_len(), 1.0),
                    reverse=True)
    assert [s.output_token_ids for s in ranked] == reference_beam_search(prompt, p, 32, eos=None)


def test_bad_beam_updates_raise() -> None:
    m = _make()
    sched = m.scheduler
    sched.add_request("b", [1, 2, 3], _beam_params(2), eos_token_id=EOS)
    out = sched.schedule()
    seq_id = out.scheduled_seq_groups[0].seqs[0].seq_id
    # A runner result that does not match the step is a bug: InternalError, nothing changed.
    with pytest.raises(InternalError, match="candidates"):
        record_step(sched, out, {})
    with pytest.raises(InternalError, match="candidates"):
        record_step(sched, out, {}, beams={"b": [BeamCandidate(seq_id + 1000, 1, -1.0)]})
    with pytest.raises(InternalError, match="not a beam-search request"):
        record_step(sched, out, {}, beams={"zzz": [BeamCandidate(seq_id, 1, -1.0)]})
    record_step(sched, out, {}, beams={"b": [BeamCandidate(seq_id, 1, -1.0), BeamCandidate(seq_id, 2, -2.0)]})
    group = sched.get_seq_group("b")
    assert sorted(s.output_token_ids for s in group.get_seqs()) == [[1], [2]]
    bm = sched.block_manager
    t0, t1 = (bm.get_block_table(s) for s in group.get_seqs())
    assert t0 == t1 and all(bm.device_allocator.ref_count(b) == 2 for b in t0)
    sched.abort_seq_group("b")
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks
