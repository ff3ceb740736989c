"""Engine configuration: plain dataclasses, validated once when built.

Every check raises ``ValueError`` naming the field, so a bad value is caught where the
config is made rather than deep inside the scheduler.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Literal, Optional

logger = logging.getLogger(__name__)

GiB = 1 << 30

#: The most logprobs / prompt_logprobs a request may ask for, unless the engine is built
#: with another max_logprobs (vLLM's default). The server's --max-logprobs defaults to it.
DEFAULT_MAX_LOGPROBS = 20


def check_int(name: str, value: object, minimum: Optional[int] = None) -> int:
    """``value`` as a plain int (bool and float refused), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_number(name: str, value: object) -> float:
    """``value`` as a finite float (an int or float; bool, str, None, NaN and inf refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        result = float(value)
    except (OverflowError, ValueError):
        result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return result


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def total_memory_bytes() -> Optional[int]:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None

SchedulerPolicy = Literal["fcfs", "priority", "shortest_first"]
PreemptionMode = Literal["recompute", "swap"]

_POLICIES = ("fcfs", "priority", "shortest_first")
_PREEMPTION_MODES = ("recompute", "swap")


def kv_cache_block_bytes(
    num_layers: int, num_kv_heads: int, head_size: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes one KV block takes across all layers (a key and a value tensor per layer)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("block_size", block_size),
        ("dtype_bytes", dtype_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_size * block_size * dtype_bytes


@dataclass
class CacheConfig:
    """Shape of the paged KV cache.

    num_gpu_blocks / num_cpu_blocks are given directly here; the cache engine (a later
    issue) derives them from memory and builds the config with them. ``None`` means "not
    known yet": the block manager refuses a config without num_gpu_blocks, and treats a
    missing num_cpu_blocks as no swap space.
    """

    block_size: int = 16
    num_gpu_blocks: Optional[int] = None
    num_cpu_blocks: Optional[int] = None
    # CPU swap space per GPU, in GiB; only used to derive num_cpu_blocks.
    swap_space_gib: float = 4.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    # Fraction of GPU blocks new prompts may not take, so running sequences can grow.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        self.block_size = check_int("block_size", self.block_size, 1)
        if self.num_gpu_blocks is not None:
            self.num_gpu_blocks = check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if self.num_cpu_blocks is not None:
            self.num_cpu_blocks = check_int("num_cpu_blocks", self.num_cpu_blocks)
            if self.num_cpu_blocks < 0:
                raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        self.swap_space_gib = check_number("swap_space_gib", self.swap_space_gib)
        if not self.swap_space_gib >= 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        self.gpu_memory_utilization = check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        self.watermark = check_number("watermark", self.watermark)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def cpu_blocks_for(self, block_bytes: int) -> int:
        """How many CPU blocks of ``block_bytes`` each fit in swap_space_gib."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
        return int(self.swap_space_gib * GiB) // block_bytes

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * (self.num_gpu_blocks or 0))


@dataclass
class SchedulerConfig:
    """Budgets and policies of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    max_model_len: int = 2048
    # None: max(max_model_len, 2048) without chunked prefill, 512 with it (as vLLM).
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = False
    policy: SchedulerPolicy = "fcfs"
    # None: vLLM's default, recompute for single-sequence groups, swap for larger ones.
    preemption_mode: Optional[PreemptionMode] = None
    # Anti-starvation bound: a request waiting this many steps jumps ahead of the policy.
    max_wait_steps: int = 256

    def __post_init__(self) -> None:
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_model_len = check_int("max_model_len", self.max_model_len, 1)
        if self.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = check_int(
                "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        self.max_wait_steps = check_int("max_wait_steps", self.max_wait_steps)
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}")
        if self.preemption_mode is not None and self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {_PREEMPTION_MODES} or None, "
                f"got {self.preemption_mode!r}"
            )
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                512 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt runs whole, so the longest one must fit a step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) unless enable_chunked_prefill is set"
            )
