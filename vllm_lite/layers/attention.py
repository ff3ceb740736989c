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

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

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
    """

    is_prompt: bool
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    max_seq_len: int
    block_size: int
    # Host copies of seq_lens / query_start_loc for the prefill loop, read once per step
    # (not once per layer: on a GPU every .tolist() is a device sync).
    _host: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)

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


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Installs ``meta`` for the duration of the block, restoring the previous one."""
    previous = getattr(_CURRENT, "meta", None)
    set_attention_metadata(meta)
    try:
        yield meta
    finally:
        set_attention_metadata(previous)


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
        if self.k_cache is not None and self.v_cache is not None:
            from vllm_lite import ops  # the native ops; only needed once a cache exists

            ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                  self.kv_cache_dtype, self.k_scale, self.v_scale)
        if meta.is_prompt:
            out = self._prefill(q, k, v, meta)
        else:
            out = self._decode(q, meta)
        return out.reshape(out.shape[0], self.num_heads * self.head_size)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("a decode step needs the KV cache (k_cache/v_cache are None)")
        if q.shape[0] != meta.num_seqs:
            raise ValueError(
                f"decode step with {q.shape[0]} tokens for {meta.num_seqs} sequences; "
                "each sequence must contribute exactly one token (use is_prompt=True for "
                "mixed batches)"
            )
        from vllm_lite import ops

        # The new token was just written to the cache, so the kernel sees the whole context.
        return ops.paged_attention(
            q, self.k_cache, self.v_cache, self.num_kv_heads, self.scale, meta.block_tables,
            meta.seq_lens, meta.block_size, meta.max_seq_len, None, self.kv_cache_dtype,
            self.k_scale, self.v_scale,
        )

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # One SDPA call per sequence (a Python loop over sequences, never over tokens).
        # TODO(engine): a varlen kernel (flash-attn varlen / a paged prefill kernel) would
        # replace this loop and the prefix gather.
        seq_lens, starts = meta.host_lists()
        out = torch.empty_like(q)
        single = self._single_token_rows(seq_lens, starts)
        if single:
            self._decode_rows(q, out, meta, single, starts)
        done = set(single)
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            num_new = end - start
            if num_new == 0 or i in done:
                continue
            prefix_len = seq_len - num_new
            qi, ki, vi = q[start:end], k[start:end], v[start:end]
            mask: torch.Tensor | None = None
            if prefix_len > 0:
                # Prefix caching or a later chunk of a chunked prefill: the earlier tokens'
                # K/V are only in the paged cache.
                pk, pv = self._gather_prefix(meta.block_tables[i], prefix_len,
                                             meta.block_size, ki.dtype)
                ki = torch.cat((pk, ki), dim=0)
                vi = torch.cat((pv, vi), dim=0)
                # New token j sits at position prefix_len + j: it sees every prefix token
                # and the new tokens up to itself (bottom-right aligned causal mask).
                rows = torch.arange(num_new, device=q.device)[:, None] + prefix_len
                cols = torch.arange(seq_len, device=q.device)[None, :]
                mask = cols <= rows
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1).unsqueeze(0),
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _single_token_rows(self, seq_lens: list[int], starts: list[int]) -> list[int]:
        """Sequences contributing one token after a cached context: the decodes of a mixed
        prefill + decode step. The decode kernel serves them all in one call, instead of a
        gather of each one's whole context and an SDPA per sequence and layer."""
        if self.k_cache is None or self.v_cache is None:
            return []
        return [i for i, n in enumerate(seq_lens) if starts[i + 1] - starts[i] == 1 and n > 1]

    def _decode_rows(self, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                     rows: list[int], starts: list[int]) -> None:
        from vllm_lite import ops

        # Their new K/V are already in the cache (forward writes them first).
        tokens = torch.tensor([starts[i] for i in rows], dtype=torch.long, device=q.device)
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        seq_lens = meta.seq_lens.index_select(0, index)
        max_len = max(meta.host_lists()[0][i] for i in rows)
        out.index_copy_(0, tokens, ops.paged_attention(
            q.index_select(0, tokens), self.k_cache, self.v_cache, self.num_kv_heads,
            self.scale, meta.block_tables.index_select(0, index), seq_lens, meta.block_size,
            max_len, None, self.kv_cache_dtype, self.k_scale, self.v_scale,
        ))

    def _gather_prefix(
        self, block_table: torch.Tensor, prefix_len: int, block_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``prefix_len`` tokens from the paged cache, [prefix_len,
        num_kv_heads, head_size] each, in ``dtype``."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "a prefill with a cached prefix (seq_len > new tokens) needs the KV cache"
            )
        num_blocks = (prefix_len + block_size - 1) // block_size
        blocks = block_table[:num_blocks].to(torch.long)
        # key_cache [blocks, kv_heads, head_size / x, block_size, x] -> [tokens, kv_heads, head_size]
        k = self.k_cache.index_select(0, blocks).permute(0, 3, 1, 2, 4)
        k = k.reshape(num_blocks * block_size, self.num_kv_heads, self.head_size)
        # value_cache [blocks, kv_heads, head_size, block_size] -> [tokens, kv_heads, head_size]
        v = self.v_cache.index_select(0, blocks).permute(0, 3, 1, 2)
        v = v.reshape(num_blocks * block_size, self.num_kv_heads, self.head_size)
        k, v = k[:prefix_len], v[:prefix_len]
        if self.kv_cache_dtype != "auto":
            # fp8 bytes -> the stored float8 values (exact in every activation dtype) x scale.
            from vllm_lite import ops

            fp8 = ops.fp8_cache_dtype(self.kv_cache_dtype)
            k = k.view(fp8).to(dtype)
            v = v.view(fp8).to(dtype)
            if self.k_scale != 1.0:
                k = k * self.k_scale
            if self.v_scale != 1.0:
                v = v * self.v_scale
        return k, v

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, scale={self.scale:.4g}")
