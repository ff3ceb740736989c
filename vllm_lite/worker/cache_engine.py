"""The paged KV cache: per-layer key/value tensors on the device plus a CPU swap pool.

Layouts are the kernels' (``ops.kv_cache_shapes``). The cache engine binds each layer's
device tensors to the model's attention layers (``k_cache`` / ``v_cache``) and runs a
step's block operations before the forward: swap out, swap in, then copy-on-write copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from vllm_lite import ops
from vllm_lite.config.schema import GiB, kv_cache_block_bytes
from vllm_lite.errors import InternalError
from vllm_lite.worker.cpu_malloc import empty_huge_pages

logger = logging.getLogger(__name__)

BlockMapping = Sequence[tuple[int, int]]


def _layer_geometry(model: nn.Module) -> list[tuple[int, int]]:
    """(num_kv_heads, head_size) of every attention layer."""
    return [(a.num_kv_heads, a.head_size) for a in model.attention_layers()]


def cache_block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return sum(
        kv_cache_block_bytes(1, heads, head_size, block_size, elem)
        for heads, head_size in _layer_geometry(model)
    )


def num_blocks_for_cpu(model: nn.Module, block_size: int, dtype: torch.dtype,
                       kv_cache_space_gib: float) -> int:
    """Device blocks when the device is the CPU: kv_cache_space GiB of them."""
    n = int(kv_cache_space_gib * GiB) // cache_block_bytes(model, block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_space {kv_cache_space_gib} GiB holds no KV block")
    return n


@torch.inference_mode()
def profile_num_gpu_blocks(model: nn.Module, block_size: int, dtype: torch.dtype,
                           device: torch.device, max_num_batched_tokens: int,
                           max_num_seqs: int, gpu_memory_utilization: float) -> int:
    """CUDA: run a prefill of max_num_batched_tokens dummy tokens without a cache, and give
    the KV cache what is left of gpu_memory_utilization * total memory after that peak."""
    from vllm_lite.layers.attention import AttentionMetadata, attention_metadata

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    per_seq = max_num_batched_tokens // num_seqs
    lens = [per_seq] * num_seqs
    lens[-1] += max_num_batched_tokens - per_seq * num_seqs
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        is_prompt=True,
        slot_mapping=torch.full((max_num_batched_tokens,), -1, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=device),
        max_seq_len=max(lens),
        block_size=block_size,
        max_query_len=max(lens),
    )
    saved = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    for a in model.attention_layers():
        a.k_cache = a.v_cache = None
    try:
        with attention_metadata(meta):
            hidden = model(ids, positions)
            logits = model.compute_logits(hidden[torch.tensor(starts[1:], device=device) - 1])
            # The sampler's float32 copy and log_softmax of them count in the peak too.
            torch.log_softmax(logits.float(), dim=-1)
        torch.cuda.synchronize(device)
    finally:
        for a, (k, v) in zip(model.attention_layers(), saved):
            a.k_cache, a.v_cache = k, v
    peak = torch.cuda.max_memory_allocated(device)
    _, total = torch.cuda.mem_get_info(device)
    available = int(total * gpu_memory_utilization) - peak
    n = available // cache_block_bytes(model, block_size, dtype)
    logger.info("profiling: peak %.2f GiB of %.2f GiB; %d KV blocks", peak / GiB, total / GiB, n)
    if n < 1:
        raise ValueError(
            f"no memory left for the KV cache (peak {peak / GiB:.2f} GiB, budget "
            f"{total * gpu_memory_utilization / GiB:.2f} GiB): raise gpu_memory_utilization"
        )
    torch.cuda.empty_cache()
    return int(n)


class CacheEngine:
    """Owns the device caches (bound to the model's attention layers) and the CPU pool.

    ``dtype`` is the cache tensors' (``ops.kv_cache_storage_dtype``: the model's, or uint8
    for an fp8 ``kv_cache_dtype``), which the layers are told along with the caches."""

    def __init__(self, model: nn.Module, block_size: int, num_gpu_blocks: int,
                 num_cpu_blocks: int, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: str = "auto") -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        self.layers = model.attention_layers()
        pin = self.device.type == "cuda"
        self.gpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in self.layers:
            k_shape, v_shape = ops.kv_cache_shapes(
                num_gpu_blocks, attn.num_kv_heads, attn.head_size, block_size, dtype
            )
            # empty, not zeros: a slot is always written before it is read, and on the CPU
            # untouched pages cost no memory. CPU pools lie wholly in huge pages: a decode
            # step reads scattered 2 KiB tiles, fewer TLB misses (cpu_malloc).
            if self.device.type == "cpu":
                k, v = empty_huge_pages(k_shape, dtype), empty_huge_pages(v_shape, dtype)
            else:
                k = torch.empty(k_shape, dtype=dtype, device=self.device)
                v = torch.empty(v_shape, dtype=dtype, device=self.device)
            self.gpu_cache.append((k, v))
            attn.k_cache, attn.v_cache = k, v
            attn.kv_cache_dtype = kv_cache_dtype
            if num_cpu_blocks > 0:
                ck_shape, cv_shape = ops.kv_cache_shapes(
                    num_cpu_blocks, attn.num_kv_heads, attn.head_size, block_size, dtype
                )
                self.cpu_cache.append((
                    torch.empty(ck_shape, dtype=dtype, pin_memory=pin),
                    torch.empty(cv_shape, dtype=dtype, pin_memory=pin),
                ))

    @staticmethod
    def _mapping(pairs: BlockMapping, device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pairs), dtype=torch.int64, device=device).reshape(-1, 2)

    def swap_out(self, pairs: BlockMapping) -> None:
        """Device blocks -> CPU blocks, (src device block, dst CPU block) pairs."""
        self._swap(pairs, to_cpu=True)

    def swap_in(self, pairs: BlockMapping) -> None:
        """CPU blocks -> device blocks, (src CPU block, dst device block) pairs."""
        self._swap(pairs, to_cpu=False)

    def _swap(self, pairs: BlockMapping, to_cpu: bool) -> None:
        if not pairs:
            return
        self._require_cpu_pool()
        mapping = self._mapping(pairs, torch.device("cpu"))
        for device_kv, cpu_kv in zip(self.gpu_cache, self.cpu_cache):
            for dev_cache, cpu_cache in zip(device_kv, cpu_kv):  # K, then V
                if to_cpu:
                    ops.swap_blocks(dev_cache, cpu_cache, mapping)
                else:
                    ops.swap_blocks(cpu_cache, dev_cache, mapping)

    def copy(self, pairs: BlockMapping) -> None:
        """Device block -> device block (copy-on-write), all layers at once."""
        if not pairs:
            return
        mapping = self._mapping(pairs, self.device)
        ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache], mapping)

    def execute(self, swap_out: BlockMapping, swap_in: BlockMapping, copies: BlockMapping) -> None:
        """A step's block operations, in the order the scheduler requires."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(copies)

    def _require_cpu_pool(self) -> None:
        if not self.cpu_cache:
            raise InternalError("the scheduler asked for a swap but there is no CPU swap pool")
