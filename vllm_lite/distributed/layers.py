"""Megatron-style shards of a model's layers over a :class:`TensorParallelGroup`.

How a Llama splits (vllm_lite.models.llama builds its layers with these sizes):
- q/k/v and gate/up (one fused GEMM each) are column-parallel: each rank computes its own
  attention heads and its slice of the MLP's intermediate features, no communication;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the inputs, and
  one all-reduce per layer sums the partial outputs (the bias is added by rank 0 only);
- the embedding and the LM head are vocabulary-parallel (rows ``[r V/N, (r+1) V/N)`` of
  the vocabulary padded to a multiple of N): a lookup outside a rank's rows gives zeros
  and an all-reduce fills every row; the head's logits are gathered along the vocabulary.

With one rank (``tp`` None) every layer is exactly the unsplit one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.distributed.group import TensorParallelGroup, kv_head_range, shard_range


@dataclass(frozen=True)
class Shard:
    """Which part of the model a rank holds (rank 0 of 1: all of it)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, tp: TensorParallelGroup | None) -> Shard:
        return cls() if tp is None else cls(tp.rank, tp.size)

    def range(self, total: int) -> tuple[int, int]:
        return shard_range(total, self.rank, self.size)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        return kv_head_range(num_kv_heads, self.rank, self.size)

    def padded_vocab(self, vocab_size: int) -> int:
        """The vocabulary rounded up to a multiple of the ranks (padding rows are zeros)."""
        return -(-vocab_size // self.size) * self.size


def all_reduce(tp: TensorParallelGroup | None, t: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks of a row-parallel layer's partial output (identity for one rank)."""
    return t if tp is None else tp.all_reduce(t.contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows [start, start + num_embeddings) of the padded vocabulary."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallelGroup | None) -> None:
        shard = Shard.of(tp)
        self.vocab_size = vocab_size
        self.vocab_start, rows = shard.range(shard.padded_vocab(vocab_size))
        super().__init__(rows, dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def load_rows(self, full: torch.Tensor) -> None:
        """Copies this rank's rows of a [vocab, dim] checkpoint tensor (zeros past it)."""
        end = min(self.vocab_start + self.num_embeddings, full.shape[0])
        n = max(end - self.vocab_start, 0)
        with torch.no_grad():
            self.weight[n:].zero_()
            if n:
                self.weight[:n].copy_(full[self.vocab_start:end])


def gather_vocab(tp: TensorParallelGroup | None, local: torch.Tensor,
                 vocab_size: int) -> torch.Tensor:
    """[T, vocab_size] logits from every rank's [T, rows] logits of its vocabulary rows."""
    if tp is None:
        return local
    return tp.all_gather_last_dim(local)[..., :vocab_size]


def shard_kept_weight(w: Any, dim: int, segments: list[tuple[int, int]]) -> Any:
    """This rank's part of a kept quantized projection (Int4Weight: qweight uint8 [N, K / 2]
    nibbles, scales / zeros [N, K / group]; Int8GroupWeight: qweight int8 [N, K], scales
    [N, K / group]), given the model's ``tp_segments``: rows (dim 0) are cut anywhere,
    columns (dim 1, a row-parallel layer's inputs) only at whole groups and in the inputs'
    own order (ValueError otherwise: GPTQ act-order permutes them)."""
    g = w.group_size
    has_zeros = hasattr(w, "zeros")
    if dim == 0:
        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[s:s + n] for s, n in segments]).contiguous()
        parts = {"qweight": rows(w.qweight), "scales": rows(w.scales)}
        if has_zeros:
            parts["zeros"] = rows(w.zeros)
        return dataclasses.replace(w, **parts)
    (start, size), = segments
    if start % g or size % g:
        raise ValueError(f"a tensor-parallel shard of {size} inputs at {start} does not hold "
                         f"whole groups of {g} weights")
    if getattr(w, "perm", None) is not None:
        raise ValueError("a GPTQ act-order checkpoint (desc_act) cannot be split over "
                         "tensor-parallel ranks: its groups mix the inputs of all ranks")
    per_byte = 2 if has_zeros else 1  # int4: two weights per byte

    def cols(t: torch.Tensor, unit: int) -> torch.Tensor:
        return t[:, start // unit:(start + size) // unit].contiguous()
    parts = {"qweight": cols(w.qweight, per_byte), "scales": cols(w.scales, g)}
    if has_zeros:
        parts["zeros"] = cols(w.zeros, g)
    return dataclasses.replace(w, **parts)


def shard_kept_weights(model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """A kept checkpoint's projections (module name -> weight) cut to this rank's part."""
    out = {}
    for name, w in weights.items():
        seg = model.tp_segments(name)
        out[name] = w if seg is None else shard_kept_weight(w, *seg)
    return out
