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

import numpy as np
import torch
from torch import nn

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.layers.attention import AttentionMetadata, attention_metadata
from vllm_lite.layers.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow
from vllm_lite.errors import DistributedError, InternalError
from vllm_lite.worker.cuda_graphs import DecodeGraphs
from vllm_lite.worker.input_batch import BlockTableRows, StepStaging


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
    # sample_indices then prompt_logprob_indices, as one tensor when the runner laid them
    # out so (None: concatenated on demand).
    logits_rows: torch.Tensor | None = None
    # True when the logits rows are every token of the batch in order (a step of plain
    # decodes only): the LM head takes the hidden states as they are.
    logits_all_rows: bool = False

    @property
    def logits_index(self) -> torch.Tensor:
        """The flat-batch rows the LM head runs on: sampled rows, then prompt-logprob rows."""
        if self.logits_rows is not None:
            return self.logits_rows
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
        self._tables = BlockTableRows()
        self._staging = StepStaging(self.device)
        # The sampling rows of the last step, by seq_id: a sequence sampling again reuses
        # its row (only its cumulative logprob moves; its token list is the live one).
        self._rows: dict[int, SamplingRow] = {}
        # Captured decode graphs (a GPU without --enforce-eager; set by the worker once
        # the KV cache exists), else None: every step eager.
        self.graphs: DecodeGraphs | None = None

    def prepare_input(self, out: SchedulerOutput) -> ModelInput | None:
        """The step's flat batch, or None when nothing is scheduled.

        Per sequence it reads only its new tokens and the table the scheduler gave it (a
        persistent row, rewritten where it changed); the integer inputs go into one
        staging buffer and to the device in one copy."""
        plp_idx: list[np.ndarray] = []
        plp_spans: list[tuple[Any, int, int]] = []
        is_prompt = False
        max_blocks = 1
        tables = self._tables
        last_rows, step_rows = self._rows, {}
        lane = out.lane
        if lane is not None:
            # The plain decodes, first in the batch: one token each (the one sampled last)
            # at position computed, sampled.
            seqs = lane.seqs
            ids = [seq.output_token_ids[-1] for seq in seqs]
            starts = list(lane.computed)
            counts = [1] * len(ids)
            rows_of = tables.rows_for(lane.seq_ids, lane.tables)
            max_blocks = max(max_blocks, max(map(len, lane.tables)))
            sample_idx = list(range(len(ids)))
            # A lane sequence that sampled last step reuses its row as it is: the row was
            # built for this very sequence (its group, its live token list) with one
            # sample, and its cumulative logprob is read by beam search only, never a
            # lane row's.
            rows = list(map(last_rows.get, lane.seq_ids))
            if None in rows:
                for i, row in enumerate(rows):
                    if row is None:
                        rows[i] = SamplingRow.for_seq(lane.groups[i], seqs[i])
            step_rows = dict(zip(lane.seq_ids, rows))
        else:
            ids, starts, counts, rows_of, sample_idx, rows = [], [], [], [], [], []
        for sched in out.groups:
            group = sched.seq_group
            wants_plp = group.sampling_params.prompt_logprobs is not None
            for s in sched.seqs:
                start, n = s.num_computed_tokens, s.num_new_tokens
                if n < 1:
                    continue
                seq = group.get_seq(s.seq_id)
                if seq is None:
                    raise InternalError(f"scheduled seq {s.seq_id} is not in {group.request_id}")
                if wants_plp:
                    span = self._prompt_logprob_span(group, start, n)
                    if span is not None and not any(g is group for g, _, _ in plp_spans):
                        first, count = span
                        plp_idx.append(np.arange(count) + (len(ids) - start + first))
                        plp_spans.append((group, first, count))
                if n == 1:
                    output = seq.output_token_ids
                    if output and start == len(seq.prompt_token_ids) + len(output) - 1:
                        ids.append(output[-1])  # a decode: the token sampled last
                    else:
                        ids.append(seq.token_slice(start, start + 1)[0])
                else:
                    ids.extend(seq.token_slice(start, start + n))
                    is_prompt = True
                if s.is_prompt:
                    is_prompt = True
                starts.append(start)
                counts.append(n)
                table = s.block_table
                rows_of.append(tables.row_of(s.seq_id, table))
                if len(table) > max_blocks:
                    max_blocks = len(table)
                if s.do_sample:
                    sample_idx.append(len(ids) - 1)
                    row = last_rows.get(s.seq_id)
                    if (row is not None and row.request is group and row.num_samples == 1
                            and row.output_token_ids is seq.output_token_ids):
                        row.cumulative_logprob = seq.cumulative_logprob
                    else:
                        row = SamplingRow.for_seq(group, seq)
                    step_rows[s.seq_id] = row
                    rows.append(row)
        tables.end_step()
        self._rows = step_rows
        if not counts:
            return None
        num_tokens, num_seqs = len(ids), len(counts)
        num_plp = sum(len(x) for x in plp_idx)
        num_logits = len(sample_idx) + num_plp
        # int64: ids, positions, slots, logits rows; int32: seq_lens, query starts, tables.
        h64, h32 = self._staging.start(3 * num_tokens + num_logits,
                                       2 * num_seqs + 1 + num_seqs * max_blocks)
        bs = self.block_size
        h64[:num_tokens] = ids
        positions = h64[num_tokens:2 * num_tokens]
        seq_lens = h32[:num_seqs]
        seq_lens[:] = starts
        block_tables = h32[2 * num_seqs + 1:].reshape(num_seqs, max_blocks)
        tables.gather(rows_of, max_blocks, block_tables)
        query_start = h32[num_seqs:2 * num_seqs + 1]
        query_start[0] = 0
        if num_tokens == num_seqs:
            # A decode step: one token a sequence, at its position start.
            positions[:] = seq_lens
            steps = np.arange(num_seqs + 1)
            seq_index = steps[:-1]
            seq_lens += 1
            query_start[:] = steps
        else:
            counts_np = np.asarray(counts, dtype=np.int64)
            seq_index = np.repeat(np.arange(num_seqs), counts_np)
            np.cumsum(counts_np, out=query_start[1:], dtype=np.int32)
            offsets = np.cumsum(counts_np) - counts_np
            positions[:] = np.arange(num_tokens) - offsets[seq_index] + seq_lens[seq_index]
            seq_lens += counts_np.astype(np.int32)
        slots = h64[2 * num_tokens:3 * num_tokens]
        np.multiply(block_tables[seq_index, positions // bs], bs, out=slots)
        slots += positions % bs
        if lane is not None and not out.groups:
            h64[3 * num_tokens:] = seq_index  # every row a lane row: each samples
        else:
            h64[3 * num_tokens:3 * num_tokens + len(sample_idx)] = sample_idx
        if plp_idx:
            h64[3 * num_tokens + len(sample_idx):] = np.concatenate(plp_idx)
        max_seq_len = int(seq_lens.max())
        d64, d32 = self._staging.finish()
        logits_index = d64[3 * num_tokens:]
        meta = AttentionMetadata(
            is_prompt=is_prompt,
            slot_mapping=d64[2 * num_tokens:3 * num_tokens],
            seq_lens=d32[:num_seqs],
            query_start_loc=d32[num_seqs:2 * num_seqs + 1],
            block_tables=d32[2 * num_seqs + 1:].view(num_seqs, max_blocks),
            max_seq_len=max_seq_len,
            block_size=bs,
            max_query_len=max(counts),
        )
        return ModelInput(
            input_ids=d64[:num_tokens],
            positions=d64[num_tokens:2 * num_tokens],
            attn_metadata=meta,
            sample_indices=logits_index[:len(sample_idx)],
            sampling_metadata=SamplingMetadata(rows),
            prompt_logprob_indices=logits_index[len(sample_idx):],
            prompt_logprob_spans=plp_spans,
            logits_rows=logits_index,
            logits_all_rows=lane is not None and not out.groups,
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
            logits = self._forward(inp.input_ids, inp.positions, inp.attn_metadata,
                                   None if inp.logits_all_rows else index)
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
        return self._forward(input_ids, positions, meta, logits_index)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, logits_index: torch.Tensor | None) -> torch.Tensor:
        """run_model inside the caller's inference mode; ``logits_index`` None: every
        token's row, in order."""
        graphs = self.graphs
        if (graphs is not None and not meta.is_prompt
                and graphs.bucket(int(input_ids.shape[0])) is not None):
            hidden = graphs.run(input_ids, positions, meta)
        else:
            with attention_metadata(meta):
                hidden = self.model(input_ids, positions)
        if logits_index is None:
            return self.model.compute_logits(hidden)
        if not logits_index.numel():
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logits_index))
