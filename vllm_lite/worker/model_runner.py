"""Turns one SchedulerOutput into one flat forward pass and samples its tokens.

Every scheduled sequence contributes its new tokens [num_computed_tokens,
num_computed_tokens + num_new_tokens) to one unpadded batch (prefix-cache hits and earlier
chunks are skipped: their KV is in the cache). Slots come from the step's block tables.
A step with any multi-token sequence (a prompt, a chunk, a recompute) runs as a prompt
step, which the attention layer serves for mixed prefill + decode batches too.

Logits are computed only for the rows that need them: the last new token of each sampled
sequence and, for a request asking for prompt logprobs, every prompt position of this
step's chunk whose logprobs are still missing (the last position of a chunk predicts the
first token of the next one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.layers.attention import AttentionMetadata, attention_metadata
from vllm_lite.layers.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow
from vllm_lite.errors import DistributedError, InternalError


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Flat-batch index of the last new token of each sampled sequence, in row order.
    sample_indices: torch.Tensor
    sampling_metadata: SamplingMetadata
    # Flat-batch indices of the prompt positions whose logits give prompt logprobs, and per
    # request (group, first position, number of positions), in that order.
    prompt_logprob_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    prompt_logprob_spans: list[tuple[Any, int, int]] = field(default_factory=list)

    @property
    def logits_index(self) -> torch.Tensor:
        """The flat-batch rows the LM head runs on: sampled rows, then prompt-logprob rows."""
        return torch.cat([self.sample_indices, self.prompt_logprob_indices])


@dataclass
class RunnerOutput:
    """One step's results: the sampler's output (None when no sequence samples), the
    sampled rows, and per request_id the prompt logprobs of this step's chunk
    (compute_prompt_logprobs' list, to append to group.prompt_logprobs)."""

    sampler_output: SamplerOutput | None
    metadata: SamplingMetadata
    prompt_logprobs: dict[str, list[dict[int, Any] | None]] = field(default_factory=dict)


class ModelRunner:
    """``before_forward(model_input, logits_index)``: called with each step's inputs just
    before the forward (the tensor-parallel driver broadcasts them to the other ranks)."""

    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 sampler: Sampler | None = None,
                 before_forward: Callable[[ModelInput, torch.Tensor], None] | None = None
                 ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler if sampler is not None else Sampler()
        self.before_forward = before_forward

    def prepare_input(self, out: SchedulerOutput) -> ModelInput | None:
        """The step's flat batch, or None when nothing is scheduled."""
        ids: list[int] = []
        pos_starts: list[int] = []
        counts: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_idx: list[int] = []
        rows: list[SamplingRow] = []
        plp_idx: list[torch.Tensor] = []
        plp_spans: list[tuple[Any, int, int]] = []
        is_prompt = False
        for sched in out.scheduled_seq_groups:
            group = sched.seq_group
            for s in sched.seqs:
                seq = group.get_seq(s.seq_id)
                if seq is None:
                    raise InternalError(f"scheduled seq {s.seq_id} is not in {group.request_id}")
                start, n = s.num_computed_tokens, s.num_new_tokens
                if n < 1:
                    continue
                tokens = seq.get_token_ids()
                span = self._prompt_logprob_span(group, start, n)
                if span is not None and not any(g is group for g, _, _ in plp_spans):
                    first, count = span
                    plp_idx.append(torch.arange(count) + (len(ids) - start + first))
                    plp_spans.append((group, first, count))
                ids.extend(tokens[start:start + n])
                pos_starts.append(start)
                counts.append(n)
                seq_lens.append(start + n)
                tables.append(s.block_table)
                if n > 1 or s.is_prompt:
                    is_prompt = True
                if s.do_sample:
                    sample_idx.append(len(ids) - 1)
                    rows.append(SamplingRow.for_seq(group, seq))
        if not counts:
            return None
        dev = self.device
        bs = self.block_size
        num_seqs = len(counts)
        max_blocks = max(1, max(len(t) for t in tables))
        table_rows = [t + [0] * (max_blocks - len(t)) for t in tables]
        block_tables = torch.tensor(table_rows, dtype=torch.int32)
        if len(ids) == num_seqs:
            # A decode step (one token a sequence): its position and slot straight from the
            # lists; the tensor expansion below costs ~10 small ops a step.
            positions = torch.tensor(pos_starts, dtype=torch.long)
            slot_mapping = torch.tensor(
                [t[p // bs] * bs + p % bs for t, p in zip(tables, pos_starts)], dtype=torch.long)
            query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
        else:
            counts_t = torch.tensor(counts, dtype=torch.long)
            # positions: start_i + (0 .. n_i - 1) for every sequence, without a per-token loop.
            seq_index = torch.repeat_interleave(torch.arange(num_seqs), counts_t)
            offsets = torch.cumsum(counts_t, 0) - counts_t
            positions = (torch.arange(len(ids)) - offsets[seq_index]
                         + torch.tensor(pos_starts)[seq_index])
            blocks = block_tables[seq_index, positions // bs].to(torch.long)
            slot_mapping = blocks * bs + positions % bs
            query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
            query_start_loc[1:] = torch.cumsum(counts_t, 0)
        meta = AttentionMetadata(
            is_prompt=is_prompt,
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            max_seq_len=max(seq_lens),
            block_size=bs,
            max_query_len=max(counts),
        )
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            attn_metadata=meta,
            sample_indices=torch.tensor(sample_idx, dtype=torch.long).to(dev, non_blocking=True),
            sampling_metadata=SamplingMetadata(rows),
            prompt_logprob_indices=(torch.cat(plp_idx) if plp_idx else torch.empty(0, dtype=torch.long))
            .to(dev, non_blocking=True),
            prompt_logprob_spans=plp_spans,
        )

    @staticmethod
    def _prompt_logprob_span(group: Any, start: int, n: int) -> tuple[int, int] | None:
        """(first position, count) of the prompt positions in [start, start + n) whose
        logits the group still needs for its prompt logprobs, or None. Position p predicts
        token p + 1; the count may be 0 (a one-token prompt still gets its [None])."""
        if group.sampling_params.prompt_logprobs is None:
            return None
        prompt_len = len(group.prompt_token_ids)
        done = len(group.prompt_logprobs) if group.prompt_logprobs is not None else 0
        if done >= prompt_len:
            return None
        first = max(done - 1, 0)
        if not start <= first < start + n:
            return None  # chunks arrive in order, so an earlier one covered it or a later will
        return first, max(min(start + n, prompt_len - 1) - first, 0)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs the step: forward, sampling, prompt logprobs."""
        inp = self.prepare_input(out)
        if inp is None:
            return RunnerOutput(None, SamplingMetadata([]))
        # One lm_head call for the sampled rows and the prompt-logprob rows together.
        index = inp.logits_index
        if self.before_forward is not None:
            self.before_forward(inp, index)
        try:
            logits = self.run_model(inp.input_ids, inp.positions, inp.attn_metadata, index)
        except DistributedError:
            raise
        except Exception as e:
            if self.before_forward is None:
                raise
            # The other ranks run this step's forward too; their collectives would now pair
            # with the next step's. Nothing can be re-run: fatal.
            raise DistributedError(f"the driver's forward failed after the step's inputs "
                                   f"went to the other ranks: {e!r}") from e
        num_samples = len(inp.sampling_metadata.rows)
        if not num_samples and not inp.prompt_logprob_spans:
            return RunnerOutput(None, inp.sampling_metadata)
        result = RunnerOutput(None, inp.sampling_metadata)
        if num_samples:
            result.sampler_output = self.sampler(logits[:num_samples], inp.sampling_metadata)
        offset = num_samples
        for group, first, count in inp.prompt_logprob_spans:
            params = group.sampling_params
            result.prompt_logprobs[group.request_id] = compute_prompt_logprobs(
                logits[offset:offset + count], group.prompt_token_ids, params.prompt_logprobs,
                params, start=first)
            offset += count
        return result

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, logits_index: torch.Tensor) -> torch.Tensor:
        """The forward, then float32 logits [len(logits_index), vocab] of those rows (no
        rows without running the head: every tensor-parallel rank decides from the same
        index, so their collectives pair; a zero-row result is only ever sliced empty)."""
        with attention_metadata(meta):
            hidden = self.model(input_ids, positions)
        if not logits_index.numel():
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logits_index))
