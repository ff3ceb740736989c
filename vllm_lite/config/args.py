"""Engine options: ``EngineArgs``, every option a user can set with its help text, and the
command-line flags made from it.

``EngineArgs`` generates the ``LLM(...)`` keyword arguments and the engine flags of
``vllm-lite generate``, ``serve`` and ``bench``; ``create_engine_config()`` turns it into
the ``EngineConfig`` the engine runs with (vllm_lite.config.resolve). An option's default
is the field's default in the config that holds it (vllm_lite.config.schema); the options
that config resolves ("auto" device and dtype, the model's own context length) default
here. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm_lite.config.resolve import create_engine_config
from vllm_lite.config.schema import (
    ASYNC_OUTPUT_PROC,
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MODEL,
    DTYPE_NAMES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    KV_CACHE_LAYOUTS,
    POLICIES,
    PREEMPTION_MODES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

if TYPE_CHECKING:
    import torch


def _opt(default: Any, help: str, *, type: Any = None, choices: Any = None,
         none_means: str | None = None, metavar: str | None = None) -> Any:
    """A field of EngineArgs: its default, and what its flag needs (help text; the argparse
    type when the default is None; what None means, shown as the flag's default)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices,
                                            "none_means": none_means, "metavar": metavar})


def device_name(value: str) -> str:
    """--device's value checked as it is parsed (auto, cpu, cuda or cuda:N)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


#: --threads' help (generate, serve and the benchmarks; vllm_lite.config.host.set_threads).
THREADS_HELP = ("torch intra-op threads (default: torch's, one per core); fewer can be "
                "faster on a machine other jobs share")


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
    block_size: int = _opt(CacheConfig.block_size, "tokens per KV-cache block")
    max_num_seqs: int = _opt(SchedulerConfig.max_num_seqs, "the most sequences in one step's batch")
    max_num_batched_tokens: int | None = _opt(
        None, "the most tokens in one step", type=int,
        none_means="max(max_model_len, 2048), or 512 with chunked prefill")
    max_model_len: int | None = _opt(None, "context length (prompt + output)", type=int,
                                        none_means="the model's max_position_embeddings")
    gpu_memory_utilization: float = _opt(
        CacheConfig.gpu_memory_utilization, "fraction of the GPU's memory the model, activations and KV cache may use")
    kv_cache_space: float = _opt(EngineConfig.kv_cache_space, "GiB of KV cache when the device is the CPU")
    swap_space: float = _opt(CacheConfig.swap_space, "GiB of CPU memory for KV blocks swapped out of the "
                                  "device's cache (0: no swapping)")
    enable_prefix_caching: bool = _opt(CacheConfig.enable_prefix_caching, "reuse the KV blocks of prompts' shared prefixes")
    kv_cache_dtype: str = _opt(
        CacheConfig.kv_cache_dtype, "what the KV cache stores: auto (the --dtype) or fp8 (= fp8_e4m3) / fp8_e5m2: "
        "1 byte per element, so 2x the blocks of bfloat16 and 4x those of float32 in the same "
        "memory, at fp8 precision (scales 1.0)", choices=KV_CACHE_DTYPES)
    kv_cache_layout: str = _opt(
        CacheConfig.kv_cache_layout, "the KV cache's layout: split (vLLM's paged layout: key "
        "in 16-byte chunks of a block's tokens, value token-contiguous per dim) or flash "
        "([block, token, kv head, dim] for both, as reshape_and_cache_flash writes)",
        choices=KV_CACHE_LAYOUTS)
    enable_chunked_prefill: bool = _opt(
        SchedulerConfig.enable_chunked_prefill, "split long prompts across steps, mixed with decodes")
    preemption_mode: str | None = _opt(
        SchedulerConfig.preemption_mode, "what a sequence preempted for lack of KV blocks does", type=str,
        choices=PREEMPTION_MODES,
        none_means="recompute for single-sequence requests, swap for n / best_of / beams")
    scheduling_policy: str = _opt(SchedulerConfig.scheduling_policy, "which waiting request runs first: first come, "
                                  "lower priority value, or shortest prompt + max_tokens",
                                  choices=POLICIES)
    async_output_proc: str = _opt(
        "auto", "make a step's text and request outputs while the next step's forward runs "
        "(vLLM's async output processing; the token, stop and block decisions stay in the "
        "step that sampled, so outputs are unchanged and arrive one step later): on, off, "
        "or auto: on with one GPU, off on the CPU (the forward's threads use every core) and "
        "with tensor parallelism",
        choices=ASYNC_OUTPUT_PROC)
    seed: int = _opt(ModelConfig.seed, "seed of the engine's random state (requests without their own seed)")
    num_gpu_blocks_override: int | None = _opt(
        None, "KV blocks in the device's cache, instead of sizing it from memory", type=int,
        none_means="from --kv-cache-space (CPU) or --gpu-memory-utilization (GPU)")
    max_logprobs: int = _opt(ModelConfig.max_logprobs,
                             "the most logprobs / prompt_logprobs one request may ask for")
    quantization: str | None = _opt(
        None, "weight-only quantization of the decoder's projections at load: int8 (per "
        "output channel), int4 (groups of --quantization-group-size), gguf (a GGUF model's "
        "own Q4_0/Q4_1/Q8_0 blocks, kept), gptq / awq (a 4-bit GPTQ / AWQ checkpoint, kept), "
        "none (the weights in --dtype, a GGUF's blocks dequantized); embeddings and LM head "
        "stay in --dtype (gguf in float32 on an AVX2 or wider CPU: the file's head blocks too)",
        type=str, choices=QUANTIZATION_CHOICES,
        none_means="the checkpoint's own: gguf for a GGUF whose projections it can keep, on "
        "a CPU; gptq / awq for such a checkpoint; else none")
    quantization_group_size: int | None = _opt(
        None, "int4's group size (weights sharing a scale and zero): 32, 64 or 128; only "
        "with --quantization int4", type=int, choices=INT4_GROUP_SIZES,
        none_means=f"{DEFAULT_INT4_GROUP_SIZE} for int4")
    tensor_parallel_size: int = _opt(
        ParallelConfig.tensor_parallel_size, "split the model over this many ranks (Megatron-style: heads, MLP columns and "
        "vocabulary per rank), one process each, torch.distributed (gloo on CPU, NCCL on "
        "CUDA); rank 0 runs in the engine's process")
    distributed_timeout: float = _opt(
        ParallelConfig.distributed_timeout, "seconds a tensor-parallel collective may wait for a rank before the engine "
        "fails with an error naming it (a dead or hung worker)")
    chat_template_timeout: float = _opt(
        ModelConfig.chat_template_timeout, "seconds a chat template may take to render one conversation; past it the render "
        "is stopped and the request fails (a 400 on the server) naming the template")
    chat_template_max_chars: int = _opt(
        ModelConfig.chat_template_max_chars, "the most characters a chat template may write for one conversation; past "
        "it the render is stopped and the request fails naming the template")
    enforce_eager: bool = _opt(
        ModelConfig.enforce_eager, "run every step eagerly: no CUDA graphs for decode steps "
        "(on a GPU, decode steps otherwise replay a graph captured at start per batch size "
        "up to max_num_seqs, 256 at most); on the CPU there are no graphs, so nothing to "
        "turn off")
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
        return create_engine_config(self)

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
