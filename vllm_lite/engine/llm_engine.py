"""LLMEngine: the step loop.

    add_request(...)            -> scheduler queue
    step():  schedule -> cache block ops -> model runner (forward + sampler)
             -> scheduler.update -> incremental detokenization, stop strings
             -> RequestOutputs of the requests that ran (or were ignored) this step
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence as Seq

import torch

from vllm_lite.core.scheduler import Scheduler
from vllm_lite.detokenizer import IncrementalDetokenizer
from vllm_lite.engine.config import EngineConfig
from vllm_lite.layers.sampler import Sampler
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


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
        if params.use_beam_search:
            raise ValueError("beam search is not supported yet")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        self.validate_prompt(ids)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        group = self.scheduler.add_request(
            request_id, ids, params, priority=priority, eos_token_id=self.eos_token_id)
        self._requests[request_id] = _RequestState(prompt, ids, group)

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
        out = self.scheduler.schedule()
        outputs: List[RequestOutput] = []
        for group in out.ignored_seq_groups:
            state = self._requests.pop(group.request_id, None)
            if state is not None:
                outputs.append(self._make_output(state))
            self.sampler.free_request(group.request_id)
        self.cache_engine.execute(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        sampled: Dict[int, List[int]] = {}
        lps: Dict[int, List[float]] = {}
        tops: Dict[int, Any] = {}
        if out.scheduled_seq_groups:
            sampler_out, meta = self.runner.execute_model(out)
            if sampler_out is not None:
                for row, so in zip(meta.rows, sampler_out.outputs):
                    if so is None:  # beam rows; rejected in add_request
                        raise RuntimeError("beam search is not supported yet")
                    sampled[row.seq_id] = so.token_ids
                    lps[row.seq_id] = so.logprobs
                    tops[row.seq_id] = so.top_logprobs
        before = {s.request_id: list(s.seq_group.seqs_dict) for s in out.scheduled_seq_groups}
        self.scheduler.update(out, sampled, lps)
        for sched in out.scheduled_seq_groups:
            state = self._requests.get(sched.request_id)
            if state is None:
                continue  # aborted meanwhile
            self._process(state, before[sched.request_id], tops)
            outputs.append(self._make_output(state))
            if state.group.is_finished():
                del self._requests[sched.request_id]
                self.sampler.free_request(sched.request_id)
        return outputs

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
            if params.logprobs is not None:
                if seq.seq_id in tops:
                    top = tops[seq.seq_id]
                    entry = top[0] if top else None
                else:  # a child: its sample's index in the parent's row
                    parent_top = next((tops[s] for s in seq_ids_before if s in tops), None)
                    k = new_children.index(seq.seq_id) + 1 if seq.seq_id in new_children else 0
                    entry = parent_top[k] if parent_top and k < len(parent_top) else None
                if entry is not None:
                    state.logprobs.setdefault(seq.seq_id, []).append(entry)
            if self.tokenizer is None or not params.detokenize:
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
        chosen = seqs
        if len(seqs) > params.n:
            chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = []
        for seq in chosen:
            det = state.detoks.get(seq.seq_id)
            completions.append(CompletionOutput(
                index=seqs.index(seq),
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
            error=group.error,
        )
