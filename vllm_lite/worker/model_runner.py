"""Turns one SchedulerOutput into one flat forward pass and samples its tokens.

Every scheduled sequence contributes its new tokens [num_computed_tokens,
num_computed_tokens + num_new_tokens) to one unpadded batch (prefix-cache hits and earlier
chunks are skipped: their KV is in the cache). Slots come from the step's block tables.
A step with any multi-token sequence (a prompt, a chunk, a recompute) runs as a prompt
step, which the attention layer serves for mixed prefill + decode batches too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.layers.attention import AttentionMetadata, attention_metadata
from vllm_lite.layers.sampler import Sampler, SamplerOutput
from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Flat-batch index of the last new token of each sampled sequence, in row order.
    sample_indices: torch.Tensor
    sampling_metadata: SamplingMetadata


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 sampler: Optional[Sampler] = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler if sampler is not None else Sampler()

    def prepare_input(self, out: SchedulerOutput) -> Optional[ModelInput]:
        """The step's flat batch, or None when nothing is scheduled."""
        ids: List[int] = []
        pos_starts: List[int] = []
        counts: List[int] = []
        seq_lens: List[int] = []
        tables: List[List[int]] = []
        sample_idx: List[int] = []
        rows: List[SamplingRow] = []
        is_prompt = False
        for sched in out.scheduled_seq_groups:
            group = sched.seq_group
            for s in sched.seqs:
                seq = group.get_seq(s.seq_id)
                if seq is None:
                    raise RuntimeError(f"scheduled seq {s.seq_id} is not in {group.request_id}")
                start, n = s.num_computed_tokens, s.num_new_tokens
                if n < 1:
                    continue
                tokens = seq.get_token_ids()
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
        counts_t = torch.tensor(counts, dtype=torch.long)
        # positions: start_i + (0 .. n_i - 1) for every sequence, without a per-token loop.
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), counts_t)
        offsets = torch.cumsum(counts_t, 0) - counts_t
        positions = torch.arange(len(ids)) - offsets[seq_index] + torch.tensor(pos_starts)[seq_index]
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
        )
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            attn_metadata=meta,
            sample_indices=torch.tensor(sample_idx, dtype=torch.long).to(dev, non_blocking=True),
            sampling_metadata=SamplingMetadata(rows),
        )

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> Tuple[Optional[SamplerOutput], SamplingMetadata]:
        """Runs the step; returns the sampler's output (None when no sequence samples) and
        the sampled rows."""
        inp = self.prepare_input(out)
        if inp is None:
            return None, SamplingMetadata([])
        with attention_metadata(inp.attn_metadata):
            hidden = self.model(inp.input_ids, inp.positions)
        if not inp.sampling_metadata.rows:
            return None, inp.sampling_metadata
        logits = self.model.compute_logits(hidden.index_select(0, inp.sample_indices))
        return self.sampler(logits, inp.sampling_metadata), inp.sampling_metadata
