"""HF transformers models on vllm_lite's attention kernels.

Importing this module registers two names with ``transformers.AttentionInterface`` (and
their masks with ``AttentionMaskInterface``); nothing else needs calling::

    import vllm_lite.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="vllm_lite")
    model.generate(...)                                     # DynamicCache
    model.set_attn_implementation("vllm_lite_flash")
    model.generate_batch(prompts, generation_config)         # continuous batching

- ``"vllm_lite"``: any forward with HF's own caches. The keys and values HF holds ([batch,
  kv_heads, tokens, head_size], contiguous) are read in place as a flash-layout cache of
  one-token blocks with one KV head per (batch row, KV head) "sequence"; left padding is
  skipped through the block table. Prefill and decode both run ``varlen_paged_attention``.
- ``"vllm_lite_flash"``: the same function under a name continuous batching accepts:
  transformers' ``generate_batch`` (5.x) refuses every implementation but ``paged|eager``,
  ``sdpa`` and names containing "flash", and for "flash" names it hands the attention
  function flat varlen batches (``cu_seq_lens_q`` / ``cu_seq_lens_k``) with no mask. There
  the new keys and values are written into HF's paged cache (its ``update`` with no read
  indices, so HF gathers nothing) and ``varlen_paged_attention`` reads that cache where it
  lies: each layer's K and V page views are [pages, block_size, kv_heads, head_size], the
  flash layout, and the block table comes from HF's read indices (checked to be whole
  pages). transformers also treats a "flash" name as a request for the flash-attn package
  (or a Hub kernel of that name) when a model is loaded: the modules that preload it get a
  wrapper answering "vllm_lite_flash" with no flash-attn functions, other names unchanged. That needs HF's cache object, which the attention function is not given: the
  first call on each attention module installs a forward pre-hook that wraps the
  module's ``cache`` argument (only a ``PagedAttentionCache``, only for these two names).
  Layers whose cache is not plain full attention (sliding windows, MLA) keep HF's update.

Refused (ValueError naming the setting): dropout (training), sliding windows, softcapping,
attention sinks, non-causal modules, masks that are not left padding, and
``output_attentions``. Tried with transformers 5.25 (the version the README installs).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator,
)
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from vllm_lite import ops

NAME = "vllm_lite"
#: The name transformers' continuous batching accepts ("flash" in it): same function.
CB_NAME = "vllm_lite_flash"
NAMES = (NAME, CB_NAME)

# The kwargs entry the cache wrapper leaves for the attention function: the layer's page
# views and the sequences' cache rows (HF's read or write indices).
_PAGED_KEY = "_vllm_lite_paged_kv"


def _refuse_unsupported(module: torch.nn.Module, dropout: float, sliding_window: Any,
                        softcap: Any, s_aux: Any, kwargs: dict) -> None:
    if dropout:
        raise ValueError(f"attn_implementation {NAME!r}: dropout must be 0 (inference only), "
                         f"got {dropout}")
    if sliding_window is not None:
        raise ValueError(f"attn_implementation {NAME!r}: sliding_window is not supported, got "
                         f"{sliding_window}")
    if softcap is not None:
        raise ValueError(f"attn_implementation {NAME!r}: softcap is not supported, got {softcap}")
    if s_aux is not None:
        raise ValueError(f"attn_implementation {NAME!r}: attention sinks (s_aux) are not "
                         "supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation {NAME!r}: output_attentions is not supported")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"attn_implementation {NAME!r}: only causal attention is supported "
                         f"({type(module).__name__} is not causal)")


def _varlen(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            num_kv_heads: int, scale: float, tables: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, block_size: int) -> torch.Tensor:
    """varlen_paged_attention over flash-layout caches; query [tokens, heads, head_size]."""
    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if len(seq_lens) else 0
    max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
    return ops.varlen_paged_attention(
        query, key_cache, value_cache, num_kv_heads, scale, tables, seq_lens, query_start_loc,
        block_size, max_query_len, max_seq_len, None, "auto", 1.0, 1.0)


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           padding: torch.Tensor | None, scale: float) -> torch.Tensor:
    """HF's own cache ([B, kv_heads, Tk, D] keys and values) read in place: sequence
    s = b * kv_heads + h is KV head h of row b, one KV head, its tokens one-token blocks
    (block s * Tk + t), its query heads the group of h. Returns [B, Tq, H, D]."""
    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    G = H // Hkv
    dev = query.device
    kc = key.contiguous().view(B * Hkv * Tk, 1, 1, D)
    vc = value.contiguous().view(B * Hkv * Tk, 1, 1, D)
    if padding is None:
        pads = torch.zeros(B, dtype=torch.int64, device=dev)
    else:
        pads = Tk - padding.sum(dim=1)
        positions = torch.arange(Tk, device=dev)
        if not torch.equal(padding.bool(), positions[None, :] >= pads[:, None]):
            raise ValueError(f"attn_implementation {NAME!r}: the attention mask must be left "
                             "padding (zeros, then ones in each row)")
    lens = Tk - pads                                              # context per row
    n_q = Tq - (pads - (Tk - Tq)).clamp(min=0)                    # real query tokens per row
    seq_lens = lens.repeat_interleave(Hkv).to(torch.int32)
    qsl = torch.zeros(B * Hkv + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(n_q.repeat_interleave(Hkv), 0)
    first = torch.arange(B * Hkv, device=dev) * Tk + pads.repeat_interleave(Hkv)
    tables = (first[:, None] + torch.arange(Tk, device=dev)[None, :]).to(torch.int32)
    tables = torch.minimum(tables, torch.tensor(B * Hkv * Tk - 1, device=dev, dtype=torch.int32))
    # Query rows in (row, KV head, token) order; left-padded query tokens are left out.
    real = torch.arange(Tq, device=dev)[None, :] >= (Tq - n_q)[:, None]       # [B, Tq]
    real = real[:, None, :].expand(B, Hkv, Tq)
    q5 = query.view(B, Hkv, G, Tq, D).transpose(2, 3)                          # [B, Hkv, Tq, G, D]
    out_rows = _varlen(q5[real], kc, vc, 1, scale, tables, seq_lens, qsl, 1)
    out5 = query.new_zeros(B, Hkv, Tq, G, D)
    out5[real] = out_rows
    return out5.permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D)


def _paged(query: torch.Tensor, num_kv_heads: int, cu_q: torch.Tensor, cu_k: torch.Tensor,
           paged: tuple, scale: float) -> torch.Tensor:
    """Continuous batching on HF's paged cache: query [1, H, Tq, D] (flat over sequences).
    Returns [1, Tq, H, D]."""
    k_pages, v_pages, rows = paged
    bs = k_pages.shape[1]
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    seq_lens = cu_k[1:] - cu_k[:-1]
    starts = cu_k[:-1].long()
    n_tok = int(cu_q[-1])
    max_len = int(seq_lens.max()) if len(seq_lens) else 0
    cols = max(1, -(-max_len // bs))
    # Block j of sequence i is the page holding its token j * bs; every token t must then
    # sit at offset t % bs of page table[i, t // bs] (HF fills whole pages per request).
    pos = starts[:, None] + torch.arange(cols, device=rows.device)[None, :] * bs
    pos = torch.minimum(pos, torch.tensor(max(rows.numel() - 1, 0), device=rows.device))
    tables = (rows[pos] // bs if rows.numel() else torch.zeros_like(pos)).to(torch.int32)
    total = int(cu_k[-1])
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=rows.device), seq_lens.long())
    t = torch.arange(total, device=rows.device) - starts[seq]
    expect = tables[seq, t // bs].long() * bs + t % bs
    if not torch.equal(expect, rows[:total].long()):
        raise RuntimeError("vllm_lite attention: HF's cache rows are not whole pages per "
                           "sequence; cannot read the paged cache through a block table")
    H, D = query.shape[1], query.shape[3]
    q = query[0].transpose(0, 1)[:n_tok]                                       # [n, H, D]
    out = query.new_zeros(1, query.shape[2], H, D)
    out[0, :n_tok] = _varlen(q, k_pages, v_pages, num_kv_heads, scale, tables, seq_lens,
                             cu_q, bs)
    return out


def _flat_gathered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """A varlen batch whose keys and values HF already gathered ([1, Hkv, total_k, D]):
    read as a flash cache of one-token blocks. Returns [1, Tq, H, D]."""
    Hkv, D = key.shape[1], key.shape[3]
    kc = key[0].transpose(0, 1).contiguous().view(-1, 1, Hkv, D)
    vc = value[0].transpose(0, 1).contiguous().view(-1, 1, Hkv, D)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    seq_lens = cu_k[1:] - cu_k[:-1]
    cols = max(1, int(seq_lens.max()) if len(seq_lens) else 1)
    tables = cu_k[:-1, None] + torch.arange(cols, device=cu_k.device, dtype=torch.int32)[None, :]
    tables = torch.minimum(tables, torch.tensor(max(kc.shape[0] - 1, 0), dtype=torch.int32))
    n_tok = int(cu_q[-1])
    H = query.shape[1]
    out = query.new_zeros(1, query.shape[2], H, D)
    out[0, :n_tok] = _varlen(query[0].transpose(0, 1)[:n_tok], kc, vc, Hkv, scale, tables,
                             seq_lens, cu_q, 1)
    return out


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs: Any
                      ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [B, H, Tq, D], key / value
    [B, Hkv, Tk, D]; returns ([B, Tq, H, D], None)."""
    _refuse_unsupported(module, dropout, sliding_window, softcap, s_aux, kwargs)
    _install_cache_hook(module)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        raise ValueError(f"attn_implementation {NAME!r}: query, key and value must share a "
                         f"head size, got {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and isinstance(cu_k, torch.Tensor):  # a continuous-batching step
        if query.shape[0] != 1:
            raise ValueError(f"attn_implementation {NAME!r}: a varlen batch must be flat "
                             f"(batch 1), got {query.shape[0]}")
        paged = kwargs.get(_PAGED_KEY)
        if paged is not None:
            return _paged(query, key.shape[1], cu_q, cu_k, paged, scale), None
        return _flat_gathered(query, key, value, cu_q, cu_k, scale), None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation {NAME!r}: expected no mask or a 2-D padding "
                         f"mask, got shape {tuple(attention_mask.shape)}")
    return _dense(query, key, value, attention_mask, scale), None


class _PagedCacheView:
    """HF's PagedAttentionCache for one attention layer's forward, whose ``update`` writes
    the new keys and values (HF's own allocator update, with no read indices, so nothing is
    gathered) and leaves the layer's page views and the sequences' cache rows for the
    attention function. Everything else is the cache's."""

    def __init__(self, cache: PagedAttentionCache) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._cache
        allocator = cache.layer_to_allocator[layer_idx]
        plain = type(allocator) is FullAttentionCacheAllocator
        if not plain or kwargs.get("block_table") is not None:
            return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
        k, v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
        allocator.update(k, v, layer_idx, read_index[:0], write_index)
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
        # With no cached tokens, a sequence's rows are the ones just written.
        rows = read_index if read_index.numel() else write_index
        kwargs[_PAGED_KEY] = (k_pages, v_pages, rows)
        return key_states, value_states


def _wrap_paged_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if getattr(module.config, "_attn_implementation", None) in NAMES:
        for name in ("cache", "past_key_values"):
            if isinstance(kwargs.get(name), PagedAttentionCache):
                kwargs[name] = _PagedCacheView(kwargs[name])
    return args, kwargs


def _install_cache_hook(module: torch.nn.Module) -> None:
    if not getattr(module, "_vllm_lite_cache_hook", False):
        module.register_forward_pre_hook(_wrap_paged_cache, with_kwargs=True)
        module._vllm_lite_cache_hook = True


def _flash_imports_for(real: Any) -> Any:
    """transformers' ``lazy_import_flash_attention`` for names with "flash" in them, made to
    answer our name with no flash-attn functions (as for an implementation without them)
    instead of looking for a Hub kernel named "vllm_lite_flash"; every other name is
    passed through."""
    if getattr(real, "_vllm_lite_wrapped", False):
        return real

    def lazy_import_flash_attention(implementation: str | None, *args: Any, **kwargs: Any):
        if implementation == CB_NAME:
            return (None, None, None, None, None), (dict, dict)
        return real(implementation, *args, **kwargs)

    lazy_import_flash_attention._vllm_lite_wrapped = True  # type: ignore[attr-defined]
    return lazy_import_flash_attention


def _accept_cb_name() -> None:
    """Loading a model with a "flash" name (from_pretrained, set_attn_implementation) and
    continuous batching's set-up preload flash-attn through ``lazy_import_flash_attention``;
    the modules that call it get the wrapper above."""
    import transformers.generation.continuous_batching.initialization as cb_init
    import transformers.modeling_utils as modeling_utils

    for mod in (modeling_utils, cb_init):
        mod.lazy_import_flash_attention = _flash_imports_for(mod.lazy_import_flash_attention)


_accept_cb_name()
for _name in NAMES:
    AttentionInterface.register(_name, attention_forward)
    # None where nothing is padded, else the 2-D padding mask (as flash attention's).
    AttentionMaskInterface.register(_name, flash_attention_mask)
