"""Paged attention layer and the per-step attention metadata.

The model runner describes one forward step (a flat batch of tokens from many sequences)
with an :class:`AttentionMetadata`, installed for the whole forward with
:func:`set_attention_metadata` or the :func:`attention_metadata` context manager; every
:class:`Attention` layer reads it from there (nano-vllm's global context), so the model's
``forward(input_ids, positions)`` signature carries no attention plumbing.

Each layer owns its KV cache tensors (``k_cache``/``v_cache``, in the kernel library's
paged layouts, see README "Layouts"), assigned by the runner after the model is built.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import ops
from vllm_lite.errors import InternalError


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one forward step.

    Fields:
        is_prompt: prefill step (each sequence contributes its new prompt tokens, possibly
            after a cached prefix) vs decode step (each sequence contributes exactly one
            token, attended with the paged-attention kernel).
        slot_mapping: int64 [T], cache slot of each new token (block * block_size +
            offset); -1 means "don't cache".
        seq_lens: int32 [num_seqs], total context length of each sequence *including*
            its new tokens.
        query_start_loc: int32 [num_seqs + 1], cumulative offsets of each sequence's new
            tokens in the flat batch (query_start_loc[-1] == T).
        block_tables: int32 [num_seqs, max_blocks], physical block ids per sequence.
        max_seq_len: max(seq_lens).
        block_size: tokens per cache block.
        max_query_len: max new tokens of one sequence (set by the runner; 0 = derive it).
    """

    is_prompt: bool
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    max_seq_len: int
    block_size: int
    # max of the per-sequence new-token counts (0: computed from query_start_loc).
    max_query_len: int = 0
    # Host copies of seq_lens / query_start_loc for the cache-less prefill loop, read once
    # per step (not once per layer: on a GPU every .tolist() is a device sync).
    _host: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_query_len == 0 and self.num_seqs > 0:
            starts = self.host_lists()[1]
            self.max_query_len = max(b - a for a, b in zip(starts, starts[1:]))

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_lists(self) -> tuple[list[int], list[int]]:
        """(seq_lens, query_start_loc) as Python lists, computed once and cached."""
        if self._host is None:
            seq_lens = [int(x) for x in self.seq_lens.tolist()]
            starts = [int(x) for x in self.query_start_loc.tolist()]
            if len(starts) != len(seq_lens) + 1:
                raise InternalError(
                    f"query_start_loc has {len(starts)} entries; expected num_seqs + 1 = "
                    f"{len(seq_lens) + 1}"
                )
            for i, seq_len in enumerate(seq_lens):
                n = starts[i + 1] - starts[i]
                if n < 0 or n > seq_len:
                    raise InternalError(
                        f"sequence {i}: {n} new tokens but seq_len {seq_len} "
                        "(seq_len counts the cached prefix plus the new tokens)"
                    )
            self._host = (seq_lens, starts)
        return self._host


# Per thread: two engines stepping in two threads of one process (two servers, or an
# engine embedded next to another) must each see their own batch.
_CURRENT = threading.local()


def set_attention_metadata(meta: AttentionMetadata | None) -> None:
    """Installs the metadata every Attention layer of this thread reads in the next
    forward (None clears)."""
    _CURRENT.meta = meta


def get_attention_metadata() -> AttentionMetadata:
    meta = getattr(_CURRENT, "meta", None)
    if meta is None:
        raise RuntimeError(
            "no attention metadata: call set_attention_metadata(meta) (or use the "
            "attention_metadata(meta) context manager) before the model's forward"
        )
    return meta


class attention_metadata:  # noqa: N801 (used as a function: with attention_metadata(m))
    """Installs ``meta`` for the duration of the block, restoring the previous one. A
    class, not a generator context manager: entered once per forward, where contextlib's
    generator machinery costs more than the two assignments."""

    __slots__ = ("meta", "previous")

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.previous: AttentionMetadata | None = None

    def __enter__(self) -> AttentionMetadata:
        self.previous = getattr(_CURRENT, "meta", None)
        _CURRENT.meta = self.meta
        return self.meta

    def __exit__(self, *exc: object) -> None:
        _CURRENT.meta = self.previous


class Attention(nn.Module):
    """Multi-head attention over new tokens and (optionally) a paged KV cache.

    Input q [T, num_heads, head_size], k/v [T, num_kv_heads, head_size] (rotary already
    applied); output [T, num_heads * head_size].
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Assigned by the model runner; None = no cache (pure prefill, nothing stored).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # What the caches hold (assigned with them): "auto" = this layer's dtype, or fp8
        # bytes of key / k_scale and value / v_scale. No calibrated scales yet: 1.0.
        self.kv_cache_dtype = "auto"
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is not None and v_cache is not None:
            # The caches' layout is the key cache's rank (ops.kv_cache_shapes), as the
            # attention kernels tell it.
            write = ops.reshape_and_cache_flash if k_cache.dim() == 4 else ops.reshape_and_cache
            write(k, v, k_cache, v_cache, meta.slot_mapping, self.kv_cache_dtype,
                  self.k_scale, self.v_scale)
        if meta.is_prompt:
            out = self._prefill(q, k, v, meta)
        else:
            out = self._decode(q, meta)
        return out.reshape(out.shape[0], self.num_heads * self.head_size)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("a decode step needs the KV cache (k_cache/v_cache are None)")
        if q.shape[0] != meta.seq_lens.shape[0]:
            raise ValueError(
                f"decode step with {q.shape[0]} tokens for {meta.num_seqs} sequences; "
                "each sequence must contribute exactly one token (use is_prompt=True for "
                "mixed batches)"
            )
        # The new token was just written to the cache, so the kernel sees the whole context.
        return ops.paged_attention(
            q, k_cache, v_cache, self.num_kv_heads, self.scale, meta.block_tables,
            meta.seq_lens, meta.block_size, meta.max_seq_len, None, self.kv_cache_dtype,
            self.k_scale, self.v_scale,
        )

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.k_cache is not None and self.v_cache is not None:
            # Every row of the step (fresh prompts, chunks after earlier chunks or a cached
            # prefix, the decodes of a mixed step) in one kernel call over the paged cache,
            # where forward just wrote the new tokens' K/V.
            return ops.varlen_paged_attention(
                q, self.k_cache, self.v_cache, self.num_kv_heads, self.scale,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.block_size,
                meta.max_query_len, meta.max_seq_len, None, self.kv_cache_dtype, self.k_scale,
                self.v_scale,
            )
        # No cache (the CUDA memory-profiling pass, or a model run on its own): each
        # sequence's new tokens are its whole context; one causal SDPA per sequence.
        seq_lens, starts = meta.host_lists()
        out = torch.empty_like(q)
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start != seq_len:
                raise RuntimeError(
                    f"sequence {i} has a {seq_len - (end - start)}-token prefix but there is "
                    "no KV cache to read it from (k_cache/v_cache are None)"
                )
            if seq_len == 0:
                continue
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),
                k[start:end].transpose(0, 1).unsqueeze(0),
                v[start:end].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, scale={self.scale:.4g}")
