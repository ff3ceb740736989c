"""The way back up from one step: sampler results -> one list of updates per request.

    RunnerOutput (per-row samples, beam candidates, prompt logprobs)
      -> checked against what was scheduled       a mismatch is a runner bug (InternalError)
      -> per request, before anything changes:    StopChecker's token rules (EOS, stop ids,
                                                  max_tokens, max_model_len), the new text
                                                  and logprobs, then the stop strings on it;
                                                  forks (n, best_of) and the beam decision
      -> GroupUpdate(AppendToken / ForkSeq /      what the scheduler's apply() then does,
         NewHypothesis / DropSeq, prompt logprobs) the one place sequences and blocks change

Nothing here changes a sequence, a request or a block. The output state of a sequence
(its incremental detokenizer and logprobs, SeqOutputState) is this module's own: it is
advanced here and stored on the sequence by apply(); a fork gets a copy of its parent's.
A request whose own decision raises fails alone (recorded in ``failed``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_lite.core.beam_search import BeamCandidate, Hypothesis, ScoredCandidate, select_beams
from vllm_lite.core.scheduler import (AppendToken, DecodeLane, DropSeq, Finish, ForkSeq,
                                      GroupUpdate, LaneUpdate, NewHypothesis,
                                      ScheduledSequenceGroup, SchedulerOutput, SeqUpdate)
from vllm_lite.detokenizer import TEXT_CONTEXT, IncrementalDetokenizer, token_texts_after
from vllm_lite.engine.stop_checker import StopChecker
from vllm_lite.errors import InternalError
from vllm_lite.layers.sampler import Logprob, SampleOutput, SamplerOutput
from vllm_lite.sequence import SeqOutputState, Sequence, SequenceGroup, SequenceStatus, next_seq_id
from vllm_lite.worker.model_runner import RunnerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DeferredText:
    """A sampled token whose text and logprob entries are made after its step was applied:
    ``seq_len`` is the length ``seq`` had before ``token``; ``finish`` its finish (by the
    token rules: a request with stop strings is never deferred)."""

    group: SequenceGroup
    seq: Sequence
    token: int
    entry: dict[int, Any] | None
    finish: Finish | None
    seq_len: int


def _sample_dict(so: SamplerOutput | None) -> dict[int, SampleOutput]:
    """The step's samples by sequence id."""
    return {s.seq_id: s for s in (so.outputs if so is not None else []) if s is not None}


class OutputProcessor:
    def __init__(self, stop_checker: StopChecker, tokenizer: Any = None) -> None:
        self.stop_checker = stop_checker
        self.tokenizer = tokenizer
        # The deferred-text list of the step being processed (None: text made at once).
        self._deferred: list[DeferredText] | None = None

    def process(self, out: SchedulerOutput, result: RunnerOutput,
                failed: dict[str, Exception],
                deferred: list[DeferredText] | None = None
                ) -> tuple[list[GroupUpdate], LaneUpdate | None]:
        """The step's updates: one GroupUpdate per request of ``out.groups`` that ran and
        is still in the engine, and the lane's updates as columns (None without a lane).
        A request whose own decision raises is put in ``failed`` (the engine aborts it)
        and gets no update.

        ``deferred`` (a list): the text and logprob entries of a sampled token whose
        request's finish cannot depend on text (one sequence, no stop strings, no beams)
        are not made here but recorded in it, for :meth:`finish_text` once the updates
        are applied (the engine's async output processing runs that during the next
        step's forward). Every token, finish and block decision is made here either way."""
        self._deferred = deferred
        so = result.sampler_output
        # A step of one token per row without entries comes as columns (PlainSamples):
        # its rows are found by sequence id, without a SampleOutput per row.
        plain = so.plain if so is not None else None
        row_of = (dict(zip(plain.seq_ids, range(len(plain.seq_ids))))
                  if plain is not None and out.groups else None)
        samples = _sample_dict(so) if plain is None and out.groups else None
        beams = dict(so.beams) if so is not None else {}
        self._check_results(out, so, samples, row_of, beams)
        lane_update = (self._process_lane(out.lane, so, failed)
                       if out.lane is not None else None)
        updates: list[GroupUpdate] = []
        prompt_logprobs = result.prompt_logprobs
        check_token = self.stop_checker.check_token
        for sched in out.groups:
            group = sched.seq_group
            rid = group.request_id
            if rid in failed:
                continue  # failed this step
            try:
                seqs = sched.seqs
                if len(seqs) == 1 and rid not in beams and rid not in prompt_logprobs:
                    # The usual step of a request: one sequence, at most one sample
                    # (_check_results checked it), a row of the step's columns (one token,
                    # no entries) or a SampleOutput.
                    s = seqs[0]
                    i = sample = None
                    if s.do_sample:
                        if row_of is not None:
                            i = row_of.get(s.seq_id)
                        else:
                            sample = samples.get(s.seq_id)
                    seq = (group.seqs_dict.get(s.seq_id)
                           if i is not None or sample is not None else None)
                    if seq is None or seq.is_finished():
                        if not group.is_finished():  # else aborted meanwhile
                            updates.append(GroupUpdate(rid, []))
                        continue
                    if i is not None:
                        token, logprob = plain.token_ids[i], plain.logprobs[i]
                    elif len(sample.token_ids) == 1 and not sample.top_logprobs:
                        token, logprob = sample.token_ids[0], sample.logprobs[0]
                    else:
                        updates.append(GroupUpdate(rid, self._samples(group, seq, sample)))
                        continue
                    params = group.sampling_params
                    if self.tokenizer is None or not params.detokenize:
                        # No text, no logprob entries: the token rules only.
                        output_len = len(seq.output_token_ids) + 1
                        updates.append(GroupUpdate(rid, [AppendToken(
                            s.seq_id, token, logprob, None,
                            check_token(params, group.eos_token_id, token, output_len,
                                        len(seq.prompt_token_ids) + output_len))]))
                        continue
                    updates.append(GroupUpdate(rid, [self._one_token(
                        group, seq, token, logprob, None)]))
                    continue
                if samples is None:
                    samples = _sample_dict(so)
                if group.is_finished():
                    continue  # aborted meanwhile
                updates.append(self._decide(group, sched, samples, beams.get(rid),
                                            prompt_logprobs.get(rid)))
            except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
                logger.exception("request %s failed while recording its step", rid)
                failed[rid] = e
        return updates, lane_update

    def _process_lane(self, lane: DecodeLane, so: SamplerOutput | None,
                      failed: dict[str, Exception]) -> LaneUpdate:
        """The lane's updates. Its rows are the first rows of the step's samples, in
        order: read as columns where the sampler gave them so (else by sequence id). A
        row runs on unless its token meets the request's screen of the token rules
        (StopChecker.token_limits); those rows, and the rows that make text or logprob
        entries or have stop_token_ids, take the per-row path (_one_token)."""
        n = len(lane.seqs)
        plain = so.plain if so is not None else None
        entries: list[dict[int, Any] | None] | None = None
        if plain is not None and plain.seq_ids[:n] == lane.seq_ids:
            tokens, logprobs = plain.token_ids[:n], plain.logprobs[:n]
        else:
            tokens, logprobs, entries = self._lane_samples(lane, so, failed)
        update = LaneUpdate(tokens, logprobs)
        if failed:
            update.skip = {i for i, g in enumerate(lane.groups) if g.request_id in failed}
        checked = []
        for i, (group, token, computed) in enumerate(zip(lane.groups, tokens, lane.computed)):
            limits = group.stop_limits
            if limits is None:
                limits = group.stop_limits = self._stop_limits(group)
            # With its token the sequence is computed + 2 long.
            if computed + 2 >= limits[0] or token == limits[1] or limits[2]:
                checked.append(i)
        if entries is not None:
            checked = sorted({*checked, *(i for i, e in enumerate(entries) if e is not None)})
        running = SequenceStatus.RUNNING
        skip = update.skip
        for i in checked:
            seq = lane.seqs[i]
            if seq.status is not running or i in skip:
                continue  # aborted since it was scheduled, or failed
            group = lane.groups[i]
            try:
                u = self._one_token(group, seq, tokens[i], logprobs[i],
                                    entries[i] if entries is not None else None)
            except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
                logger.exception("request %s failed while recording its step",
                                 group.request_id)
                failed[group.request_id] = e
                skip.add(i)
                continue
            if u.output is not None:
                update.outputs[i] = u.output
            if u.finish is not None:
                update.finishes[i] = u.finish
        return update

    def _stop_limits(self, group: SequenceGroup) -> tuple[int, int, bool]:
        """(cap, eos, per_row) of a lane request: StopChecker.token_limits, and whether
        every token of it takes the per-row path (stop_token_ids, text, logprob entries)."""
        params = group.sampling_params
        cap, eos = self.stop_checker.token_limits(params, group.eos_token_id,
                                                  len(group.prompt_token_ids))
        per_row = (bool(params.stop_token_ids) or params.logprobs is not None
                   or self._detokenizes(params))
        return cap, eos, per_row

    @staticmethod
    def _lane_samples(lane: DecodeLane, so: SamplerOutput | None, failed: dict[str, Exception]
                      ) -> tuple[list[int], list[float], list[dict[int, Any] | None]]:
        """The lane's samples, found by sequence id (a step whose samples are not plain
        columns, or a re-run without some requests): columns with a logprob entry per
        row (None without one); a row without its sample gets token -1 and must be
        aborted or failed (else a runner bug: InternalError)."""
        samples = _sample_dict(so)
        tokens: list[int] = []
        logprobs: list[float] = []
        entries: list[dict[int, Any] | None] = []
        for group, seq in zip(lane.groups, lane.seqs):
            s = samples.get(seq.seq_id)
            if s is None:
                if not seq.is_finished() and group.request_id not in failed:
                    raise InternalError(f"seq {seq.seq_id} must get 1 sample, got None")
                tokens.append(-1)
                logprobs.append(0.0)
                entries.append(None)
                continue
            if len(s.token_ids) != 1 or len(s.logprobs) != 1:
                raise InternalError(f"seq {seq.seq_id} must get 1 sample, got {s!r}")
            tokens.append(s.token_ids[0])
            logprobs.append(s.logprobs[0])
            entries.append(s.top_logprobs[0] if s.top_logprobs else None)
        return tokens, logprobs, entries

    def _check_results(self, out: SchedulerOutput, so: SamplerOutput | None,
                       samples: dict[int, SampleOutput] | None, row_of: dict[int, int] | None,
                       beams: dict[str, list[BeamCandidate]]) -> None:
        """Checks the step's samples (by seq_id: ``samples``, or the rows of the step's
        PlainSamples in ``row_of``, one token each) and beam candidates (by request)
        against what was scheduled, before anything is decided: a mismatch is a bug in
        the runner or sampler."""
        if beams:
            beam_requests = {s.seq_group.request_id for s in out.groups
                             if s.seq_group.sampling_params.use_beam_search}
            for rid in beams:
                if rid not in beam_requests:
                    raise InternalError(f"beam candidates for {rid!r}, not a beam-search "
                                        "request of this step")
        for sched in out.groups:
            group = sched.seq_group
            params = group.sampling_params
            if not params.use_beam_search and len(sched.seqs) == 1:
                # The usual step: one sequence scheduled, checked in one pass.
                sched_seq = sched.seqs[0]
                seq = group.seqs_dict.get(sched_seq.seq_id) if sched_seq.do_sample else None
                if seq is None or seq.is_finished():
                    continue
                if row_of is not None and seq.seq_id in row_of and (
                        params.best_of == 1 or not group.awaiting_first_sample()):
                    continue
                if samples is None:
                    samples = _sample_dict(so)
                s = samples.get(seq.seq_id)
                if s is not None and len(s.token_ids) == 1 and len(s.logprobs) == 1 \
                        and (params.best_of == 1 or not group.awaiting_first_sample()):
                    continue
                expected = (params.best_of if params.best_of > 1
                            and group.awaiting_first_sample() else 1)
                if s is None or len(s.token_ids) != expected or len(s.logprobs) != expected:
                    raise InternalError(f"seq {seq.seq_id} must get {expected} sample(s), "
                                        f"got {s!r}")
                continue
            if group.is_finished():
                continue
            if samples is None:
                samples = _sample_dict(so)
            if not params.use_beam_search:
                expected = (params.best_of if params.best_of > 1
                            and group.awaiting_first_sample() else 1)
                for sched_seq in sched.seqs:
                    if not sched_seq.do_sample:
                        continue
                    seq_id = sched_seq.seq_id
                    seq = group.get_seq(seq_id)
                    if seq is None or seq.is_finished():
                        continue
                    s = samples.get(seq_id)
                    if s is None or len(s.token_ids) != expected or len(s.logprobs) != expected:
                        raise InternalError(f"seq {seq_id} must get {expected} sample(s), "
                                            f"got {s!r}")
                continue
            sampled_ids = {s.seq_id for s in sched.seqs if s.do_sample}
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

    def _decide(self, group: SequenceGroup, sched: ScheduledSequenceGroup,
                samples: dict[int, SampleOutput], cands: list[BeamCandidate] | None,
                prompt_chunk: list[dict[int, Any] | None] | None) -> GroupUpdate:
        update = GroupUpdate(group.request_id)
        if prompt_chunk:
            self._decode_prompt_logprobs(group, prompt_chunk)
            update.prompt_logprobs = prompt_chunk
        if cands is not None:
            update.seqs = self._beam_step(group, cands)
            return update
        for s in sched.seqs:
            seq = group.get_seq(s.seq_id)
            sample = samples.get(s.seq_id)
            if not s.do_sample or sample is None or seq is None or seq.is_finished():
                continue
            update.seqs.extend(self._samples(group, seq, sample))
        return update

    # -- samples -------------------------------------------------------------------------------
    def _samples(self, group: SequenceGroup, seq: Sequence,
                 sample: SampleOutput) -> list[SeqUpdate]:
        """A group's first random sample carries best_of tokens: samples 1.. fork children
        sharing the sequence's blocks, each continuing from the sequence as it stood."""
        tops = sample.top_logprobs
        if len(sample.token_ids) == 1:  # the usual step: one token, no fork
            return [self._one_token(group, seq, sample.token_ids[0], sample.logprobs[0],
                                    tops[0] if tops else None)]
        ids = {k: next_seq_id() for k in range(1, len(sample.token_ids))}
        ups: list[SeqUpdate] = []
        own: SeqUpdate | None = None
        for k in [*ids, 0]:  # the children copy seq's output state before it moves on
            token, lp = sample.token_ids[k], sample.logprobs[k]
            entry = tops[k] if tops and k < len(tops) else None
            finish = self.stop_checker.check_token(
                group.sampling_params, group.eos_token_id, token, seq.get_output_len() + 1,
                seq.get_len() + 1)
            output, finish = self._advance(group, seq, token, entry, finish, fork=k > 0)
            if k == 0:
                own = AppendToken(seq.seq_id, token, lp, output, finish)
            else:
                ups.append(ForkSeq(seq.seq_id, ids[k], token, lp, output, finish))
        return [own, *ups] if own is not None else ups

    def _one_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                   entry: dict[int, Any] | None) -> AppendToken:
        """The update of a sequence that sampled one token (``entry``: its logprob entry,
        when the request asks for them)."""
        params = group.sampling_params
        finish = self.stop_checker.check_token(
            params, group.eos_token_id, token, len(seq.output_token_ids) + 1,
            seq.get_len() + 1)
        if entry is None and (self.tokenizer is None or not params.detokenize):
            # No text, no logprob entries: the output state does not change.
            return AppendToken(seq.seq_id, token, logprob, None, finish)
        deferred = self._deferred
        if deferred is not None and not params.stop and len(group.seqs_dict) == 1:
            # Text cannot finish this request: made later, from the state as it is.
            deferred.append(DeferredText(group, seq, token, entry, finish, seq.get_len()))
            return AppendToken(seq.seq_id, token, logprob, None, finish)
        output, finish = self._advance(group, seq, token, entry, finish, fork=False)
        return AppendToken(seq.seq_id, token, logprob, output, finish)

    def _beam_step(self, group: SequenceGroup, cands: list[BeamCandidate]) -> list[SeqUpdate]:
        """core/beam_search.py's decision as updates: kept candidates fork their parents,
        finished ones become hypotheses (copies without blocks), beams without a kept
        candidate and hypotheses pushed out of the best are dropped."""
        params = group.sampling_params
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
        ups: list[SeqUpdate] = [DropSeq(seq_id) for seq_id in decision.dropped_hypotheses]
        for sc in decision.new_hypotheses:
            c = sc.candidate
            parent = live[c.parent_seq_id]
            output, finish = self._advance(group, parent, c.token_id, c.top_logprobs,
                                           sc.finish, fork=True)
            ups.append(NewHypothesis(parent.seq_id, next_seq_id(), c.token_id, c.logprob,
                                     finish, output))
        children: dict[int, list[BeamCandidate]] = {}
        for sc in decision.continue_:
            children.setdefault(sc.candidate.parent_seq_id, []).append(sc.candidate)
        for parent in live.values():
            kids = children.get(parent.seq_id, [])
            if not kids:
                ups.append(DropSeq(parent.seq_id))
                continue
            for kid in kids[1:]:
                output, _ = self._advance(group, parent, kid.token_id, kid.top_logprobs,
                                          None, fork=True)
                ups.append(ForkSeq(parent.seq_id, next_seq_id(), kid.token_id, kid.logprob,
                                   output))
            output, _ = self._advance(group, parent, kids[0].token_id, kids[0].top_logprobs,
                                      None, fork=False)
            ups.append(AppendToken(parent.seq_id, kids[0].token_id, kids[0].logprob, output))
        return ups

    # -- logprobs and text ---------------------------------------------------------------------
    def finish_text(self, deferred: list[DeferredText]) -> dict[str, Exception]:
        """The text and logprob entries ``process`` deferred, made now (the tokens are
        applied: each record names the length its sequence had before its token). Returns
        the requests whose text failed (request_id -> exception); the others are done."""
        failed: dict[str, Exception] = {}
        for d in deferred:
            try:
                self._advance(d.group, d.seq, d.token, d.entry, d.finish, fork=False,
                              seq_len=d.seq_len)
            except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
                logger.exception("request %s failed while making its text",
                                 d.group.request_id)
                failed[d.group.request_id] = e
        return failed

    def _advance(self, group: SequenceGroup, seq: Sequence, token: int,
                 entry: dict[int, Any] | None, finish: Finish | None,
                 fork: bool, seq_len: int | None = None) -> tuple[SeqOutputState, Finish | None]:
        """The output state of ``seq`` extended by ``token`` (a copy when ``fork``; else
        seq's own state, which only this module reads), and the finish with the stop
        strings checked on the new text: a stop string wins over a token rule.
        ``seq_len``: the sequence's length before ``token`` (default: its length now, the
        token not yet applied)."""
        params = group.sampling_params
        state = seq.output.fork() if fork else seq.output
        detok = self._detokenizes(params)
        n = seq.get_len() if seq_len is None else seq_len
        if params.logprobs is not None and entry is not None:
            state.logprobs.append(entry)
            if detok:
                # Only the last tokens shape a token's text: no full copy per step.
                self._decode_logprobs(entry, seq.token_slice(max(0, n - TEXT_CONTEXT), n),
                                      group)
        if not detok:
            return state, finish
        det = state.detokenizer
        if det is None:
            det = state.detokenizer = IncrementalDetokenizer.for_params(
                self.tokenizer, group.prompt_token_ids, params)
            num_output = n - len(seq.prompt_token_ids)
            if num_output:
                det.add_tokens(seq.output_token_ids[:num_output])
        new_text = det.add_tokens([token])
        if finish is not None:
            # The text held back for an incomplete character comes out now, and a stop
            # string in it counts like one in new text.
            new_text += det.flush()
        hit = self.stop_checker.check_stop_strings(params, det.text, len(new_text))
        if hit is not None:
            stop, keep = hit
            det.text = det.text[:keep]
            finish = (SequenceStatus.FINISHED_STOPPED, stop)
        return state, finish

    def _decode_prompt_logprobs(self, group: SequenceGroup,
                                chunk: list[dict[int, Any] | None]) -> None:
        if not self._detokenizes(group.sampling_params):
            return
        start = len(group.prompt_logprobs or [])
        prompt = group.prompt_token_ids
        for pos, entry in enumerate(chunk, start):
            if entry is not None:
                self._decode_logprobs(entry, prompt[max(0, pos - TEXT_CONTEXT):pos], group)

    def _detokenizes(self, params: Any) -> bool:
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
