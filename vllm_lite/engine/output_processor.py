"""The way back up from one step: sampler results -> sequences -> RequestOutputs.

    RunnerOutput (per-row samples, beam candidates, prompt logprobs)
      -> scheduler.mark_computed                  the step's tokens are in the KV cache
      -> append / fork (n, best_of) / beam step   through the scheduler's fork_seq,
                                                  finish_seq, drop_seq (blocks follow)
      -> StopChecker                              EOS, stop ids, max_tokens, max_model_len,
                                                  then stop strings on the new text
      -> incremental detokenization, logprobs     per sequence
      -> RequestOutput                            for every request that ran

A request whose own processing raises fails alone (recorded in ``failed``, its blocks
freed); a result that does not match the step (a runner bug) raises InternalError and
fails the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_lite.core.beam_search import BeamCandidate, Hypothesis, ScoredCandidate, beam_score, select_beams
from vllm_lite.core.scheduler import Scheduler, ScheduledSequenceGroup, SchedulerOutput
from vllm_lite.detokenizer import IncrementalDetokenizer, token_texts_after
from vllm_lite.engine.stop_checker import StopChecker
from vllm_lite.errors import InternalError
from vllm_lite.layers.sampler import Logprob, SampleOutput
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id
from vllm_lite.worker.model_runner import RunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the output side keeps per request between steps."""

    prompt: str | None
    prompt_token_ids: list[int]
    group: SequenceGroup
    # Per seq_id: output tokens already handled, detokenizer, per-token top logprobs.
    seen: dict[int, int] = field(default_factory=dict)
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, Any]]] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, stop_checker: StopChecker,
                 tokenizer: Any = None) -> None:
        self.scheduler = scheduler
        self.stop_checker = stop_checker
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | None, prompt_token_ids: list[int],
                    group: SequenceGroup) -> None:
        self.requests[group.request_id] = RequestState(prompt, prompt_token_ids, group)

    def error_output(self, request_id: str, error: str) -> RequestOutput | None:
        """The final output of a request that failed (None if it is unknown); forgets it."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        state.group.error = error
        return self.make_output(state)

    def ignored_output(self, group: SequenceGroup) -> RequestOutput | None:
        """The final output of a request the scheduler ended without running it."""
        state = self.requests.pop(group.request_id, None)
        return self.make_output(state) if state is not None else None

    # -- one step ------------------------------------------------------------------------------
    def process(self, out: SchedulerOutput, result: RunnerOutput,
                failed: dict[str, Exception]) -> list[RequestOutput]:
        """Records the step and returns the outputs of the requests that ran in it. A
        request whose own processing raises is aborted and put in ``failed``."""
        samples, beams = self._check_results(out, result)
        self.scheduler.end_step(out)
        for rid, chunk in result.prompt_logprobs.items():
            self._guarded(rid, failed, self._add_prompt_logprobs, rid, chunk)
        outputs: list[RequestOutput] = []
        for sched in out.scheduled_seq_groups:
            group = sched.seq_group
            rid = group.request_id
            if rid in failed or group.is_finished():
                continue  # aborted meanwhile, or failed this step
            state = self.requests.get(rid)
            try:
                output = self._process_group(state, sched, samples, beams.get(rid))
            except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
                logger.exception("request %s failed while recording its step", rid)
                failed[rid] = e
                self.scheduler.abort_seq_group([rid])
                continue
            if output is not None:
                outputs.append(output)
            if group.is_finished():
                self.requests.pop(rid, None)
        return outputs

    def _guarded(self, rid: str, failed: dict[str, Exception], fn: Any, *args: Any) -> None:
        if rid in failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
            logger.exception("request %s failed while recording its step", rid)
            failed[rid] = e

    def _check_results(self, out: SchedulerOutput, result: RunnerOutput
                       ) -> tuple[dict[int, SampleOutput], dict[str, list[BeamCandidate]]]:
        """The step's samples by seq_id and beam candidates by request, checked against
        what was scheduled: a mismatch is a bug in the runner or sampler."""
        so = result.sampler_output
        samples = {s.seq_id: s for s in (so.outputs if so is not None else []) if s is not None}
        beams = dict(so.beams) if so is not None else {}
        beam_requests = {s.request_id for s in out.scheduled_seq_groups
                         if s.seq_group.sampling_params.use_beam_search}
        for rid in beams:
            if rid not in beam_requests:
                raise InternalError(f"beam candidates for {rid!r}, not a beam-search request "
                                    "of this step")
        for sched in out.scheduled_seq_groups:
            group = sched.seq_group
            if group.is_finished():
                continue
            params = group.sampling_params
            sampled_ids = {s.seq_id for s in sched.seqs if s.do_sample}
            if params.use_beam_search:
                if not sampled_ids:
                    continue
                live = {s.seq_id for s in group.get_seqs(SequenceStatus.RUNNING)}
                if sampled_ids != live:
                    raise InternalError(f"beam request {group.request_id!r} sampled "
                                        f"{sorted(sampled_ids)} but runs {sorted(live)}")
                cands = beams.get(group.request_id)
                if not cands or any(c.parent_seq_id not in live for c in cands):
                    raise InternalError(f"beam request {group.request_id!r} got candidates "
                                        f"{cands!r} for beams {sorted(live)}")
                continue
            expected = params.best_of if group.awaiting_first_sample() else 1
            for seq_id in sampled_ids:
                seq = group.get_seq(seq_id)
                if seq is None or seq.is_finished():
                    continue
                s = samples.get(seq_id)
                if s is None or len(s.token_ids) != expected or len(s.logprobs) != expected:
                    raise InternalError(f"seq {seq_id} must get {expected} sample(s), got {s!r}")
        return samples, beams

    def _process_group(self, state: RequestState | None, sched: ScheduledSequenceGroup,
                       samples: dict[int, SampleOutput],
                       cands: list[BeamCandidate] | None) -> RequestOutput | None:
        """Records one group's step; its output, or None for a group added to the
        scheduler directly (no request state: the scheduler tests drive it so)."""
        group = sched.seq_group
        before = list(group.seqs_dict)
        self.scheduler.mark_computed(sched)
        tops: dict[int, Any] = {}
        if cands is not None:
            extended = self._beam_step(group, cands)
            if state is not None:
                self._record_beam_logprobs(state, extended)
        else:
            for s in sched.seqs:
                seq = group.get_seq(s.seq_id)
                sample = samples.get(s.seq_id)
                if not s.do_sample or sample is None or seq is None or seq.is_finished():
                    continue
                self._append_samples(group, seq, sample)
                tops[s.seq_id] = sample.top_logprobs
        if state is None:
            return None
        self._detokenize(state, before, tops)
        return self.make_output(state)

    # -- samples -------------------------------------------------------------------------------
    def _append_samples(self, group: SequenceGroup, seq: Sequence, sample: SampleOutput) -> None:
        """A group's first random sample carries best_of tokens: the sequence forks into
        best_of sequences sharing its blocks (forked before it takes its own token)."""
        rid = group.request_id
        targets = [seq] + [self.scheduler.fork_seq(rid, seq.seq_id)
                           for _ in sample.token_ids[1:]]
        for target, token, lp in zip(targets, sample.token_ids, sample.logprobs):
            target.append_token_id(token, lp)
            verdict = self.stop_checker.check_token(
                group.sampling_params, group.eos_token_id, token, target.get_output_len(),
                target.get_len())
            if verdict is not None:
                self.scheduler.finish_seq(rid, target.seq_id, *verdict)

    def _beam_step(self, group: SequenceGroup, cands: list[BeamCandidate]
                   ) -> list[tuple[Sequence, BeamCandidate]]:
        """Applies core/beam_search.py's decision: kept candidates fork their parents
        (copy-on-write), finished ones become hypotheses (copies without blocks), dropped
        beams free their blocks at once. Returns each new or extended beam with the
        candidate it took."""
        params = group.sampling_params
        rid = group.request_id
        live = {s.seq_id: s for s in group.get_seqs(SequenceStatus.RUNNING)}
        scored = []
        for c in cands:
            parent = live[c.parent_seq_id]
            out_len = parent.get_output_len() + 1
            scored.append(ScoredCandidate(
                c, parent.cumulative_logprob + c.logprob, out_len,
                self.stop_checker.check_token(params, group.eos_token_id, c.token_id, out_len,
                                              parent.get_len() + 1)))
        hypotheses = [Hypothesis(s.seq_id, s.cumulative_logprob, s.get_output_len())
                      for s in group.get_seqs() if s.is_finished()]
        decision = select_beams(scored, hypotheses, params, self.stop_checker.max_output_len(
            params, len(group.prompt_token_ids)))
        extended: list[tuple[Sequence, BeamCandidate]] = []
        for seq_id in decision.dropped_hypotheses:
            group.remove(seq_id)
        for sc in decision.new_hypotheses:
            hyp = live[sc.candidate.parent_seq_id].fork(next_seq_id())
            hyp.append_token_id(sc.candidate.token_id, sc.candidate.logprob)
            hyp.status, hyp.stop_reason = sc.finish
            group.add(hyp)
            extended.append((hyp, sc.candidate))
        children: dict[int, list[BeamCandidate]] = {}
        for sc in decision.continue_:
            children.setdefault(sc.candidate.parent_seq_id, []).append(sc.candidate)
        for parent in live.values():
            kids = children.get(parent.seq_id, [])
            if not kids:
                self.scheduler.drop_seq(rid, parent.seq_id)
                continue
            for kid in kids[1:]:
                child = self.scheduler.fork_seq(rid, parent.seq_id)
                child.append_token_id(kid.token_id, kid.logprob)
                extended.append((child, kid))
            parent.append_token_id(kids[0].token_id, kids[0].logprob)
            extended.append((parent, kids[0]))
        return extended

    # -- logprobs and text ---------------------------------------------------------------------
    def _record_beam_logprobs(self, state: RequestState,
                              extended: list[tuple[Sequence, BeamCandidate]]) -> None:
        """Each new or extended beam inherits its parent's logprob history plus its new
        token's entry; beams no longer in the group are forgotten."""
        group = state.group
        if group.sampling_params.logprobs is not None and extended:
            # Built from the histories as they were, before a parent's is replaced.
            history = {seq.seq_id: list(state.logprobs.get(c.parent_seq_id, [])) + [c.top_logprobs]
                       for seq, c in extended}
            state.logprobs.update(history)
            if self._detokenizes(group.sampling_params):
                for seq, _ in extended:
                    self._decode_logprobs(history[seq.seq_id][-1], seq.get_token_ids()[:-1], group)
        current = set(group.seqs_dict)
        for table in (state.seen, state.detoks, state.logprobs):
            for seq_id in [s for s in table if s not in current]:
                del table[seq_id]

    def _add_prompt_logprobs(self, request_id: str, chunk: list[dict[int, Any] | None]) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        group = state.group
        if group.prompt_logprobs is None:
            group.prompt_logprobs = []
        start = len(group.prompt_logprobs)
        group.prompt_logprobs.extend(chunk)
        if self._detokenizes(group.sampling_params):
            prompt = state.prompt_token_ids
            for pos, entry in enumerate(chunk, start):
                if entry is not None:
                    self._decode_logprobs(entry, prompt[:pos], group)

    def _detokenizes(self, params: SamplingParams) -> bool:
        return self.tokenizer is not None and params.detokenize

    def _decode_logprobs(self, entry: dict[int, Logprob], context: list[int],
                         group: SequenceGroup) -> None:
        """Fill each Logprob's decoded_token: the text the token adds after ``context``."""
        params = group.sampling_params
        texts = token_texts_after(self.tokenizer, context, list(entry),
                                  params.skip_special_tokens,
                                  params.spaces_between_special_tokens)
        for lp, text in zip(entry.values(), texts):
            lp.decoded_token = text

    def _detokenize(self, state: RequestState, seq_ids_before: list[int],
                    tops: dict[int, Any]) -> None:
        """New tokens' logprob entries and text; a stop string ends its sequence."""
        group = state.group
        params = group.sampling_params
        # Children forked this step took samples 1.. of their parent's row, in order.
        new_children = [sid for sid in group.seqs_dict if sid not in seq_ids_before]
        for seq in group.get_seqs():
            seen = state.seen.get(seq.seq_id, 0)
            new_tokens = seq.output_token_ids[seen:]
            if not new_tokens:
                continue
            state.seen[seq.seq_id] = seq.get_output_len()
            if params.logprobs is not None and not params.use_beam_search:
                if seq.seq_id in tops:
                    top = tops[seq.seq_id]
                    entry = top[0] if top else None
                else:  # a child: its sample's index in the parent's row
                    parent_top = next((tops[s] for s in seq_ids_before if s in tops), None)
                    k = new_children.index(seq.seq_id) + 1 if seq.seq_id in new_children else 0
                    entry = parent_top[k] if parent_top and k < len(parent_top) else None
                if entry is not None:
                    state.logprobs.setdefault(seq.seq_id, []).append(entry)
                    if self._detokenizes(params):
                        self._decode_logprobs(entry, seq.get_token_ids()[:-1], group)
            if not self._detokenizes(params):
                continue
            det = state.detoks.get(seq.seq_id)
            if det is None:
                det = state.detoks[seq.seq_id] = IncrementalDetokenizer.for_params(
                    self.tokenizer, state.prompt_token_ids, params)
            new_text = det.add_tokens(new_tokens)
            if seq.is_finished():
                # The text held back for an incomplete character comes out now, and a
                # stop string in it counts like one in new text.
                new_text += det.flush()
            hit = self.stop_checker.check_stop_strings(params, det.text, len(new_text))
            if hit is not None:
                stop, keep = hit
                det.text = det.text[:keep]
                if seq.is_finished():  # a token rule ended it this step; the string wins
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    seq.stop_reason = stop
                else:
                    self.scheduler.finish_seq(group.request_id, seq.seq_id,
                                              SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
                continue

    # -- outputs -------------------------------------------------------------------------------
    def make_output(self, state: RequestState) -> RequestOutput:
        group = state.group
        params = group.sampling_params
        seqs = group.get_seqs()
        if params.use_beam_search:
            # Best first; the index is the rank.
            lp = params.length_penalty
            chosen = sorted(seqs, key=lambda s: beam_score(s.cumulative_logprob,
                                                           s.get_output_len(), lp),
                            reverse=True)[: params.n]
            indices = list(range(len(chosen)))
        else:
            chosen = seqs
            if len(seqs) > params.n:
                chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
            indices = [seqs.index(seq) for seq in chosen]
        completions = []
        for index, seq in zip(indices, chosen):
            det = state.detoks.get(seq.seq_id)
            completions.append(CompletionOutput(
                index=index,
                text=det.text if det is not None else "",
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=(list(state.logprobs.get(seq.seq_id, []))
                          if params.logprobs is not None else None),
                finish_reason=SequenceStatus.get_finished_reason(seq.status),
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(
            request_id=group.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            outputs=completions,
            finished=group.is_finished(),
            prompt_logprobs=(list(group.prompt_logprobs)
                             if group.prompt_logprobs is not None else None),
            error=group.error,
        )
