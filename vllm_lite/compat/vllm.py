"""vLLM's ``_custom_ops`` functions that vllm_lite implements, with vLLM's names and argument
lists, so that code written against vLLM's kernels runs on vllm_lite's by changing one
import::

    from vllm import _custom_ops as ops          # before
    from vllm_lite.compat import vllm as ops     # after

What differs from calling ``vllm_lite.ops`` directly is only the calling convention:

- ``k_scale`` / ``v_scale`` may be 1-element float32 tensors, as vLLM passes them (newer
  vLLM) or floats (older); a tensor's value is read on the host (a device sync for a CUDA
  tensor), since vllm_lite's kernels take the scale as a number; as in vLLM, they apply
  to fp8 caches only (vllm_lite's own ops scale "auto" caches too).
- the block-sparse arguments of ``paged_attention_v1/v2`` (``blocksparse_*``) are accepted
  at vLLM's defaults and refused (ValueError naming the argument) otherwise: vllm_lite has
  no block-sparse attention. ``tp_rank`` (which only matters for block-sparse) is accepted.
- ``convert_fp8`` converts between an fp8 KV cache (uint8 storage) and a float one with the
  same rounding as the fp8 caches of ``reshape_and_cache`` (torch's float8 casts).

The cache layouts are vLLM's: ``reshape_and_cache`` writes the split key layout
[num_blocks, num_kv_heads, head_size / x, block_size, x] and the value layout [num_blocks,
num_kv_heads, head_size, block_size]; ``reshape_and_cache_flash`` writes [num_blocks,
block_size, num_kv_heads, head_size]. The attention functions read either, told apart by
the key cache's rank (5-D split, 4-D flash).
"""

from __future__ import annotations

import torch

from vllm_lite import ops

__all__ = ["convert_fp8", "copy_blocks", "paged_attention_v1", "paged_attention_v2",
           "reshape_and_cache", "reshape_and_cache_flash", "swap_blocks"]

# vLLM's defaults for the block-sparse arguments: with these, attention is dense.
_DENSE = {"blocksparse_local_blocks": 0, "blocksparse_vert_stride": 0,
          "blocksparse_block_size": 64, "blocksparse_head_sliding_step": 0}


def _scales(kv_cache_dtype: str, k_scale: float | torch.Tensor,
            v_scale: float | torch.Tensor) -> tuple[float, float]:
    # vLLM applies the scales to fp8 caches only; vllm_lite's "auto" caches apply them
    # too, so for vLLM's meaning an "auto" cache gets 1.0 (the values checked all the same).
    k, v = _scale("k_scale", k_scale), _scale("v_scale", v_scale)
    return (1.0, 1.0) if kv_cache_dtype == "auto" else (k, v)


def _scale(name: str, value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a 1-element tensor or a float, got a tensor of "
                             f"shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise ValueError(f"{name} must hold a float, got {value.dtype}")
        return float(value.reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or a 1-element tensor, got "
                         f"{type(value).__name__}")
    return float(value)


def _dense_only(**blocksparse: int) -> None:
    # tp_rank only picks a rank's heads of a block-sparse pattern: with dense attention any
    # value means the same. The pattern's own arguments must stay at vLLM's defaults.
    for name, value in blocksparse.items():
        if value != _DENSE[name]:
            raise ValueError(f"{name}={value!r}: block-sparse attention is not implemented by "
                             f"vllm_lite (leave {name} at {_DENSE[name]})")


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """vLLM's ``paged_attention_v1``: decode attention, one pass (see vllm_lite.ops)."""
    _dense_only(blocksparse_local_blocks=blocksparse_local_blocks,
                blocksparse_vert_stride=blocksparse_vert_stride,
                blocksparse_block_size=blocksparse_block_size,
                blocksparse_head_sliding_step=blocksparse_head_sliding_step)
    ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                           kv_cache_dtype, *_scales(kv_cache_dtype, k_scale, v_scale))


def paged_attention_v2(
    out: torch.Tensor,
    exp_sum: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """vLLM's ``paged_attention_v2``: decode attention over 512-token partitions."""
    _dense_only(blocksparse_local_blocks=blocksparse_local_blocks,
                blocksparse_vert_stride=blocksparse_vert_stride,
                blocksparse_block_size=blocksparse_block_size,
                blocksparse_head_sliding_step=blocksparse_head_sliding_step)
    ops.paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache,
                           num_kv_heads, scale, block_tables, seq_lens, block_size,
                           max_seq_len, alibi_slopes, kv_cache_dtype,
                           *_scales(kv_cache_dtype, k_scale, v_scale))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
) -> None:
    """vLLM's ``reshape_and_cache``: key / value into the split-layout caches."""
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          *_scales(kv_cache_dtype, k_scale, v_scale))


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
) -> None:
    """vLLM's ``reshape_and_cache_flash``: key / value into flash-layout caches."""
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                kv_cache_dtype, *_scales(kv_cache_dtype, k_scale, v_scale))


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """vLLM's ``copy_blocks``: block src -> dst for each row of ``block_mapping`` [n, 2],
    in every layer's caches."""
    ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """vLLM's ``swap_blocks``: block src of ``src`` -> block dst of ``dst``, across devices."""
    ops.swap_blocks(src, dst, block_mapping)


def convert_fp8(output: torch.Tensor, input: torch.Tensor, scale: float = 1.0,
                kv_dtype: str = "fp8") -> None:
    """vLLM's ``convert_fp8``: an fp8 cache (uint8) into a float cache (each value decoded
    and multiplied by ``scale``), or a float cache into an fp8 one (each value divided by
    ``scale`` and rounded), whichever way ``input`` and ``output`` go. ``kv_dtype``: "fp8" /
    "fp8_e4m3" or "fp8_e5m2" (vLLM's "auto" is refused: there is nothing to convert)."""
    if kv_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"kv_dtype must be fp8, fp8_e4m3 or fp8_e5m2, got {kv_dtype!r}")
    if output.shape != input.shape:
        raise ValueError(f"output {tuple(output.shape)} and input {tuple(input.shape)} must "
                         "have the same shape")
    if output.device != input.device:
        raise ValueError(f"output ({output.device}) and input ({input.device}) must be on "
                         "the same device")
    scale = _scale("scale", scale)
    fp8 = ops.fp8_cache_dtype(kv_dtype)
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if input.dtype == torch.uint8 and output.dtype in floats:
        decoded = input.view(fp8).to(torch.float32)
        output.copy_((decoded * scale).to(output.dtype))
    elif input.dtype in floats and output.dtype == torch.uint8:
        output.copy_((input.to(torch.float32) / scale).to(fp8).view(torch.uint8))
    else:
        raise ValueError(f"convert_fp8 converts uint8 (fp8) <-> float32 / float16 / bfloat16, "
                         f"got input {input.dtype} and output {output.dtype}")
