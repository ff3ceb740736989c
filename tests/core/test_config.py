from __future__ import annotations

import math

import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig, kv_cache_block_bytes


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_gpu_blocks=0), "num_gpu_blocks"),
        (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
        (dict(swap_space=-1.0), "swap_space"),
        (dict(swap_space=math.nan), "swap_space"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(watermark=1.0), "watermark"),
    ],
)
def test_cache_config_rejects(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(max_wait_steps=-1), "max_wait_steps"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4, enable_chunked_prefill=True), "max_num_batched_tokens"),
        (dict(max_model_len=4096, max_num_batched_tokens=2048), "max_num_batched_tokens"),
    ],
)
def test_scheduler_config_rejects(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_scheduler_config_defaults() -> None:
    assert SchedulerConfig().max_num_batched_tokens == 2048
    assert SchedulerConfig(max_model_len=8192).max_num_batched_tokens == 8192
    assert SchedulerConfig(enable_chunked_prefill=True, max_model_len=8192).max_num_batched_tokens == 512
    # A long context is fine with chunking: prompts are split to fit the budget.
    SchedulerConfig(enable_chunked_prefill=True, max_model_len=8192, max_num_batched_tokens=256)


def test_cpu_blocks_from_swap_space() -> None:
    block_bytes = kv_cache_block_bytes(num_layers=2, num_kv_heads=4, head_size=64, block_size=16, dtype_bytes=2)
    assert block_bytes == 2 * 2 * 4 * 64 * 16 * 2
    assert CacheConfig(swap_space=1.0).cpu_blocks_for(block_bytes) == (1 << 30) // block_bytes
    assert CacheConfig(swap_space=0).cpu_blocks_for(block_bytes) == 0
    with pytest.raises(ValueError, match="block_bytes"):
        CacheConfig().cpu_blocks_for(0)
    with pytest.raises(ValueError, match="head_size"):
        kv_cache_block_bytes(1, 1, 0, 16, 2)


def test_watermark_blocks() -> None:
    assert CacheConfig(num_gpu_blocks=1000, watermark=0.01).watermark_blocks == 10
    assert CacheConfig(num_gpu_blocks=50, watermark=0.0).watermark_blocks == 0
