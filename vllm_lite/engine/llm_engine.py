"""LLMEngine: the step loop.

    add_request(...)            -> scheduler queue
    step():  schedule -> cache block ops -> model runner (forward + sampler, prompt logprobs)
             -> beam candidates of beam-search requests
             -> scheduler.update -> incremental detokenization, stop strings
             -> RequestOutputs of the requests that ran (or were ignored) this step
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence as Seq

import torch

from vllm_lite.core.beam_search import BeamCandidate, beam_score
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.detokenizer import IncrementalDetokenizer
from vllm_lite.engine.config import EngineConfig
from vllm_lite.layers.sampler import Logprob, Sampler, beam_search_candidates, top_logprob_dicts
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# Tokens of context decoded before a logprob token, so its text has the right spacing.
_DECODE_WINDOW = 5


class EngineStepError(RuntimeError):
    """A step failed. ``request_ids``: the requests it aborted (the others are intact);
    ``outputs``: what the step still produced (requests it ignored as too long)."""

    def __init__(self, request_ids: List[str], cause: Exception,
                 outputs: Optional[List["RequestOutput"]] = None) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = list(request_ids)
        self.cause = cause
        self.outputs = list(outputs or [])


@dataclass
class _RequestState:
    prompt: Optional[str]
    prompt_token_ids: List[int]
    group: SequenceGroup
    # Per seq_id: output tokens already handled, detokenizer, per-token top logprobs.
    seen: Dict[int, int] = field(default_factory=dict)
    detoks: Dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: Dict[int, List[Dict[int, Any]]] = field(default_factory=dict)
    stopped_by_string: set = field(default_factory=set)


@dataclass
class _Computed:
    """One step's model results, before anything is recorded."""

    prompt_logprobs: Dict[str, List[Optional[Dict[int, Any]]]] = field(default_factory=dict)
    sampled: Dict[int, List[int]] = field(default_factory=dict)
    lps: Dict[int, List[float]] = field(default_factory=dict)
    tops: Dict[int, Any] = field(default_factory=dict)
    beams: Dict[str, List[BeamCandidate]] = field(default_factory=dict)
    # Per beam request: seq_id -> its row of the step's logprobs.
    beam_rows: Dict[str, Dict[int, int]] = field(default_factory=dict)
    step_logprobs: Optional[torch.Tensor] = None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any = None,
                 model: Optional[torch.nn.Module] = None) -> None:
        from vllm_lite.models.loader import load_model
        from vllm_lite.worker.cache_engine import (
            CacheEngine, cache_block_bytes, num_blocks_for_cpu, profile_num_gpu_blocks)
        from vllm_lite.worker.model_runner import ModelRunner

        self.config = config
        mc = config.model_config
        self.tokenizer = tokenizer
        torch.manual_seed(mc.seed)
        if model is None:
            model, _ = load_model(mc.model, mc.dtype, config.device, mc.max_model_len)
        self.model = model
        self.dtype = next(model.parameters()).dtype
        cc = config.cache_config
        block_size = cc.block_size
        if config.num_gpu_blocks_override is not None:
            num_gpu_blocks = config.num_gpu_blocks_override
        elif config.device.type == "cpu":
            num_gpu_blocks = num_blocks_for_cpu(model, block_size, self.dtype, config.kv_cache_space)
        else:
            num_gpu_blocks = profile_num_gpu_blocks(
                model, block_size, self.dtype, config.device,
                config.scheduler_config.max_num_batched_tokens,
                config.scheduler_config.max_num_seqs, cc.gpu_memory_utilization)
        block_bytes = cache_block_bytes(model, block_size, self.dtype)
        num_cpu_blocks = cc.cpu_blocks_for(block_bytes) if cc.swap_space_gib > 0 else 0
        self.cache_config = dataclasses.replace(
            cc, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler_config, self.cache_config)
        self.cache_engine = CacheEngine(model, block_size, num_gpu_blocks, num_cpu_blocks,
                                        self.dtype, config.device)
        self.sampler = Sampler(seed=mc.seed)
        self.runner = ModelRunner(model, block_size, config.device, self.sampler)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        else:
            self.eos_token_id = mc.eos_token_id
        self._requests: Dict[str, _RequestState] = {}
        logger.info("engine: %d KV blocks of %d tokens on %s, %d CPU swap blocks",
                    num_gpu_blocks, block_size, config.device, num_cpu_blocks)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Optional[str] = None,
                    sampling_params: Optional[SamplingParams] = None,
                    prompt_token_ids: Optional[Seq[int]] = None, priority: int = 0) -> None:
        """Queue a request: a text prompt (needs a tokenizer) or token ids."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.validate_params(params)
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        self.validate_prompt(ids)
        self.validate_fits(len(ids), params)
        self.validate_priority(priority)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        group = self.scheduler.add_request(
            request_id, ids, params, priority=priority, eos_token_id=self.eos_token_id)
        self._requests[request_id] = _RequestState(prompt, ids, group)

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the engine's limits and support."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.verify_max_n(self.config.scheduler_config.max_num_seqs)
        params.verify_max_logprobs(self.config.model_config.max_logprobs)
        if params.use_beam_search and params.stop:
            # Beams are ranked before they are detokenized; stop tokens work.
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids")

    def validate_prompt(self, ids: Seq[int]) -> None:
        mc = self.config.model_config
        if not ids:
            raise ValueError("the prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt token ids must be ints")
        bad = [t for t in ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {mc.vocab_size})")
        if len(ids) > mc.max_model_len:
            raise ValueError(
                f"prompt length {len(ids)} is longer than max_model_len {mc.max_model_len}")

    def validate_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """A request whose sequences could never all be in the KV cache at once (best_of
        of them, each up to prompt + max_tokens tokens, sharing the prompt's full blocks)
        is refused: it would otherwise run until the cache is full and end early."""
        if params.max_tokens is None:
            return  # runs to max_model_len; the scheduler preempts or ends it there
        bs = self.cache_config.block_size
        total = prompt_len + params.max_tokens
        shared = prompt_len // bs
        per_seq = -(-total // bs) - shared
        needed = shared + params.best_of * per_seq
        usable = self.scheduler.usable_gpu_blocks()
        if needed > usable:
            what = (f"n={params.n}" if params.best_of == params.n
                    else f"best_of={params.best_of}")
            raise ValueError(
                f"max_tokens {params.max_tokens} with {what} and a {prompt_len}-token prompt "
                f"needs {needed} KV blocks at once, more than the cache's {usable} "
                f"({bs} tokens each); lower max_tokens or n")

    def validate_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy; this "
                             f"engine schedules {self.config.scheduler_config.policy!r}")

    def abort_request(self, request_id: str | Seq[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.scheduler.abort_seq_group(ids)
        for rid in ids:
            self._requests.pop(rid, None)
            self.sampler.free_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """One step. A request that breaks the step (a value that fails inside the shared
        sampler, a bug triggered by its state) fails alone: the step is re-run without it
        and every other request gets exactly the tokens it would have got. The step then
        raises EngineStepError naming the failed requests, carrying everyone's outputs."""
        out = self.scheduler.schedule()
        outputs: List[RequestOutput] = []
        for group in out.ignored_seq_groups:
            state = self._requests.pop(group.request_id, None)
            if state is not None:
                outputs.append(self._make_output(state))
            self.sampler.free_request(group.request_id)
        scheduled = [s.request_id for s in out.scheduled_seq_groups]
        try:
            self.cache_engine.execute(out.blocks_to_swap_out, out.blocks_to_swap_in,
                                      out.blocks_to_copy)
        except Exception as e:
            # The swap pool's contents are unknown now: every swapped group fails too.
            self._fail_step(scheduled + [g.request_id for g in self.scheduler.swapped], e, outputs)
        failed: Dict[str, Exception] = {}
        try:
            computed = self._compute_isolated(out, failed)
        except Exception as e:
            self._fail_step([r for r in scheduled if r not in failed], e, outputs, failed)
        try:
            outputs.extend(self._apply(out, computed, failed))
        except Exception as e:
            # Scheduler bookkeeping failed outside any one request: nothing is known.
            self._fail_step([r for r in scheduled if r in self._requests], e, outputs, failed)
        if failed:
            raise self._step_error(failed, outputs)
        return outputs

    def _step_error(self, failed: Dict[str, Exception],
                    outputs: List[RequestOutput]) -> EngineStepError:
        """Aborts the failed requests and adds a finished, error-carrying output for each."""
        for rid, cause in failed.items():
            state = self._requests.get(rid)
            self.abort_request(rid)
            if state is not None:
                state.group.error = f"the engine failed while running this request: {cause!r}"
                outputs.append(self._make_output(state))
        cause = next(iter(failed.values()))
        return EngineStepError(list(failed), cause, outputs)

    def _fail_step(self, request_ids: List[str], cause: Exception,
                   outputs: List[RequestOutput],
                   failed: Optional[Dict[str, Exception]] = None) -> None:
        """A failed step leaves its requests in an unknown state: abort them (their blocks
        are free at once) and tell the caller which ones; the engine serves on."""
        failed = dict(failed or {})
        for rid in request_ids:
            failed.setdefault(rid, cause)
        raise self._step_error(failed, outputs) from cause

    # Re-runs allowed while looking for the requests that broke a step: a bisection finds
    # one culprit among n requests in about 2 log2(n) runs; past this many the remaining
    # suspects all fail (a step that breaks for everybody is not worth more forwards).
    _MAX_ISOLATION_RUNS = 32

    def _compute_isolated(self, out: Any, failed: Dict[str, Exception]) -> "_Computed":
        """The step's forward and sampling. If it raises, re-run halves of the batch
        (random states restored each time, the KV writes are the same values again) to
        find the requests that make it fail, record them in ``failed`` (request_id ->
        exception) and run the others once more: their results are exactly those of a
        step without the failed requests."""
        snap = self.sampler.snapshot()
        try:
            return self._compute(out)
        except Exception as e:
            groups = list(out.scheduled_seq_groups)
            if len(groups) <= 1:
                raise
            logger.warning("step %d failed (%r); looking for the request that broke it",
                           out.step, e)
            budget = [self._MAX_ISOLATION_RUNS]
            culprits: Dict[str, Exception] = {}
            self._bisect(out, groups, snap, culprits, budget, e)
            if not culprits or len(culprits) == len(groups):
                raise
        failed.update(culprits)
        for rid in culprits:
            # Out of the scheduler now, so the update below skips them.
            self.scheduler.abort_seq_group([rid])
        logger.error("step %d: request(s) %s failed alone; the others go on", out.step,
                     ", ".join(culprits))
        self.sampler.restore(snap)
        rest = dataclasses.replace(
            out, scheduled_seq_groups=[g for g in groups if g.request_id not in culprits])
        return self._compute(rest)

    def _bisect(self, out: Any, groups: List[Any], snap: Any, culprits: Dict[str, Exception],
                budget: List[int], cause: Exception) -> None:
        """Adds to ``culprits`` the groups of ``groups`` (a failing set) that fail alone."""
        if len(groups) == 1:
            culprits[groups[0].request_id] = cause
            return
        half = len(groups) // 2
        for part in (groups[:half], groups[half:]):
            if budget[0] <= 0:
                for g in part:  # out of re-runs: every remaining suspect fails
                    culprits.setdefault(g.request_id, cause)
                continue
            budget[0] -= 1
            self.sampler.restore(snap)
            try:
                self._compute(dataclasses.replace(out, scheduled_seq_groups=part))
            except Exception as e:  # noqa: BLE001  (narrowing down which request broke it)
                self._bisect(out, part, snap, culprits, budget, e)

    def _compute(self, out: Any) -> "_Computed":
        """Forward + sampling + beam candidates; touches no request or scheduler state
        (only the KV slots of this step and the sampler's random states)."""
        computed = _Computed()
        if not out.scheduled_seq_groups:
            return computed
        result = self.runner.execute_model(out)
        computed.prompt_logprobs = result.prompt_logprobs
        sampler_out, meta = result.sampler_output, result.metadata
        if sampler_out is None:
            return computed
        computed.step_logprobs = sampler_out.logprobs
        for i, (row, so) in enumerate(zip(meta.rows, sampler_out.outputs)):
            if row.params.use_beam_search:
                computed.beam_rows.setdefault(row.request_id, {})[row.seq_id] = i
                continue
            computed.sampled[row.seq_id] = so.token_ids
            computed.lps[row.seq_id] = so.logprobs
            computed.tops[row.seq_id] = so.top_logprobs
        groups = {s.request_id: s.seq_group for s in out.scheduled_seq_groups}
        for rid, rows in computed.beam_rows.items():
            computed.beams[rid] = self._beam_candidates(groups[rid], rows, sampler_out.logprobs)
        return computed

    def _apply(self, out: Any, computed: "_Computed",
               failed: Dict[str, Exception]) -> List[RequestOutput]:
        """Records the step (scheduler update, prompt logprobs, detokenization, stop
        strings) and builds the outputs; a request whose own bookkeeping raises fails
        alone (into ``failed``)."""
        outputs: List[RequestOutput] = []
        for rid, chunk in computed.prompt_logprobs.items():
            self._guarded(rid, failed, self._add_prompt_logprobs, rid, chunk)
        before = {s.request_id: list(s.seq_group.seqs_dict) for s in out.scheduled_seq_groups}
        group_errors: Dict[str, Exception] = {}
        self.scheduler.update(out, computed.sampled, computed.lps, computed.beams,
                              errors=group_errors)
        for rid, e in group_errors.items():
            logger.error("request %s failed in the scheduler update: %r", rid, e)
            failed.setdefault(rid, e)
        for sched in out.scheduled_seq_groups:
            rid = sched.request_id
            state = self._requests.get(rid)
            if state is None or rid in failed:
                continue  # aborted meanwhile, or failed this step
            try:
                if rid in computed.beam_rows and computed.step_logprobs is not None:
                    self._record_beam_logprobs(state, before[rid], computed.beam_rows[rid],
                                               computed.step_logprobs)
                self._process(state, before[rid], computed.tops)
                outputs.append(self._make_output(state))
            except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
                logger.exception("request %s failed while recording its step", rid)
                failed[rid] = e
                continue
            if state.group.is_finished():
                del self._requests[rid]
                self.sampler.free_request(rid)
        return outputs

    def _guarded(self, rid: str, failed: Dict[str, Exception], fn: Any, *args: Any) -> None:
        if rid in failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001  (this request fails, the others go on)
            logger.exception("request %s failed while recording its step", rid)
            failed[rid] = e

    @staticmethod
    def _beam_candidates(group: SequenceGroup, rows: Dict[int, int],
                         logprobs: torch.Tensor) -> List[BeamCandidate]:
        """The best 2 * beam_width extensions over all live beams of a group."""
        seq_ids = list(rows)
        index = torch.tensor([rows[s] for s in seq_ids], dtype=torch.long, device=logprobs.device)
        group_lps = logprobs.index_select(0, index)
        cum = [group.get_seq(s).cumulative_logprob for s in seq_ids]
        cands = beam_search_candidates(group_lps, cum, group.sampling_params.best_of)
        beam_idx = torch.tensor([b for b, _, _ in cands], dtype=torch.long, device=logprobs.device)
        token_idx = torch.tensor([t for _, t, _ in cands], dtype=torch.long, device=logprobs.device)
        token_lps = group_lps[beam_idx, token_idx].tolist()
        return [BeamCandidate(seq_ids[b], t, lp) for (b, t, _), lp in zip(cands, token_lps)]

    def _record_beam_logprobs(self, state: _RequestState, seq_ids_before: List[int],
                              rows: Dict[int, int], logprobs: torch.Tensor) -> None:
        """Each beam extended this step inherits its parent's logprob history plus the
        entry of its new token (from the parent's row); dropped beams are forgotten."""
        group = state.group
        k = group.sampling_params.logprobs
        extended = []  # (seq, parent id)
        for seq in group.get_seqs():
            if seq.seq_id in rows:
                extended.append((seq, seq.seq_id))  # a beam that continued itself
            elif seq.seq_id not in seq_ids_before:
                extended.append((seq, seq.parent_seq_id))
        if k is not None and extended:
            dev = logprobs.device
            row_idx = torch.tensor([rows[p] for _, p in extended], dtype=torch.long, device=dev)
            tokens = torch.tensor([s.get_last_token_id() for s, _ in extended], dtype=torch.long,
                                  device=dev)
            entries = top_logprob_dicts(logprobs.index_select(0, row_idx), tokens, [k] * len(extended))
            # Built from the histories as they were, before a parent's is replaced.
            history = {seq.seq_id: list(state.logprobs.get(parent, [])) + [entry]
                       for (seq, parent), entry in zip(extended, entries)}
            state.logprobs.update(history)
            if self._detokenizes(group.sampling_params):
                for seq, _ in extended:
                    self._decode_logprobs(history[seq.seq_id][-1], seq.get_token_ids()[:-1], group)
        current = set(group.seqs_dict)
        for table in (state.seen, state.detoks, state.logprobs):
            for seq_id in [s for s in table if s not in current]:
                del table[seq_id]

    def _add_prompt_logprobs(self, request_id: str, chunk: List[Optional[Dict[int, Any]]]) -> None:
        state = self._requests.get(request_id)
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

    def _decode_logprobs(self, entry: Dict[int, Logprob], context: Seq[int],
                         group: SequenceGroup) -> None:
        """Fill each Logprob's decoded_token: the text the token adds after ``context``."""
        skip = group.sampling_params.skip_special_tokens
        window = list(context[-_DECODE_WINDOW:])
        prefix = self.tokenizer.decode(window, skip_special_tokens=skip)
        for token_id, lp in entry.items():
            text = self.tokenizer.decode(window + [token_id], skip_special_tokens=skip)
            lp.decoded_token = (text[len(prefix):] if text.startswith(prefix)
                                else self.tokenizer.decode([token_id], skip_special_tokens=skip))

    def _process(self, state: _RequestState, seq_ids_before: List[int], tops: Dict[int, Any]) -> None:
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
                det = state.detoks[seq.seq_id] = IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids, params.skip_special_tokens)
            new_text = det.add_tokens(new_tokens)
            if params.stop and self._check_stop_strings(state, seq, det, len(new_text)):
                continue
            if seq.is_finished():
                det.flush()

    def _check_stop_strings(self, state: _RequestState, seq: Any, det: IncrementalDetokenizer,
                            num_new_chars: int) -> bool:
        params = state.group.sampling_params
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        if not num_new_chars:
            return False
        longest = max(len(s) for s in stops)
        search_from = max(0, len(det.text) - num_new_chars - longest + 1)
        for stop in stops:
            idx = det.text.find(stop, search_from)
            if idx < 0:
                continue
            end = idx + len(stop) if params.include_stop_str_in_output else idx
            det.text = det.text[:end]
            state.stopped_by_string.add(seq.seq_id)
            if seq.is_finished():
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop
            else:
                self.scheduler.finish_seq(state.group.request_id, seq.seq_id,
                                          SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
            return True
        return False

    def _make_output(self, state: _RequestState) -> RequestOutput:
        group = state.group
        params = group.sampling_params
        seqs = group.get_seqs()
        if params.use_beam_search:
            # Best first; the index is the rank.
            lp = params.length_penalty
            chosen = sorted(seqs, key=lambda s: beam_score(s.cumulative_logprob, s.get_output_len(), lp),
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
                logprobs=list(state.logprobs.get(seq.seq_id, [])) if params.logprobs is not None else None,
                finish_reason=SequenceStatus.get_finished_reason(seq.status),
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(
            request_id=group.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            outputs=completions,
            finished=group.is_finished(),
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            error=group.error,
        )
