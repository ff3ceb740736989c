"""The one step from options to config: ``create_engine_config(EngineArgs) -> EngineConfig``.

It checks every option (a ``ValueError`` naming it; the cheap checks before the model is
converted or read), finds the model (an alias or a .gguf file becomes its converted HF
folder), reads its HF config, and decides what the options leave open: the device
("auto"), the dtype ("auto": decided per device, logged), the quantization (None: the
checkpoint's own) and the CPUs to bind. Torch and the model loaders are imported when
called, so importing vllm_lite.config stays cheap and cycle-free.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_lite.config import host
from vllm_lite.config.schema import (
    ASYNC_OUTPUT_PROC,
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DTYPE_NAMES,
    INT4_GROUP_SIZES,
    GiB,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    check_bool,
    check_int,
    check_number,
    check_quantization,
)

if TYPE_CHECKING:
    import torch

    from vllm_lite.config.args import EngineArgs

logger = logging.getLogger(__name__)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Validates every option of ``args`` and builds the engine's config."""
    import torch

    model_config = _model_config(args)
    cache_config = CacheConfig(
        block_size=args.block_size, swap_space=args.swap_space,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_layout=args.kv_cache_layout)
    device = resolve_device(args.device)
    parallel_config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                     distributed_timeout=args.distributed_timeout)
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_model_len=model_config["max_model_len"],
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
        async_output_proc=resolve_async_output_proc(args.async_output_proc, device.type,
                                                    parallel_config.tensor_parallel_size))

    hf_config = model_config["hf_config"]
    name = resolve_dtype_name(args.dtype, device.type, hf_config)
    if args.dtype == "auto":
        logger.debug("dtype auto: %s on %s (checkpoint: %s)", name, device.type,
                     checkpoint_dtype(hf_config) or "not stated")
    kv_cache_space = check_number("kv_cache_space", args.kv_cache_space)
    if not kv_cache_space > 0:
        raise ValueError(f"kv_cache_space must be > 0 GiB, got {kv_cache_space}")
    total = host.total_memory_bytes()
    if total is not None:
        # Both are host memory: more than the whole machine can never be allocated.
        # (Their sum is not checked: the pools are allocated lazily by the OS, and the
        # defaults, 4 + 4 GiB, must keep working on small machines.)
        for option, gib in (("kv_cache_space", kv_cache_space),
                            ("swap_space", cache_config.swap_space)):
            if gib * GiB > total:
                raise ValueError(f"{option} {gib} GiB is more than this machine's memory "
                                 f"({total / GiB:.1f} GiB)")
    override = args.num_gpu_blocks_override
    if override is not None and (isinstance(override, bool) or not isinstance(override, int)
                                 or override < 1):
        raise ValueError(f"num_gpu_blocks_override must be a positive int, got {override!r}")
    quantization = resolve_quantization(model_config["quantization"], model_config["gguf_file"],
                                        hf_config, device.type)
    if quantization is not None:
        from vllm_lite.models.registry import get_model_class

        model_cls = get_model_class(getattr(hf_config, "architectures", None))
        if _is_moe(hf_config):
            _check_moe_quantization(model_cls, hf_config, quantization,
                                    args.quantization_group_size, model_config["model"],
                                    parallel_config.tensor_parallel_size)
    cpus = None
    if args.cpu_threads_bind is not None:
        if device.type != "cpu":
            raise ValueError(f"cpu_threads_bind binds CPU threads; the device is {device}")
        if parallel_config.tensor_parallel_size > 1:
            raise ValueError("cpu_threads_bind with tensor_parallel_size > 1 is not "
                             "supported (each rank would need its own CPUs)")
        spec = args.cpu_threads_bind
        if isinstance(spec, (list, tuple)):  # CPU numbers given as a list: checked the same
            spec = ",".join(map(str, spec))
        cpus = host.parse_cpu_ids(spec)
    parallel_config.check_model(hf_config, quantization, args.quantization_group_size)
    tp = parallel_config.tensor_parallel_size
    if tp > 1 and device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"device {device} with tensor_parallel_size {tp}: rank r "
                             "runs on cuda:r; use device 'cuda'")
        if tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {tp} is more than the "
                             f"{torch.cuda.device_count()} CUDA device(s) torch sees")
    return EngineConfig(
        model_config=ModelConfig(**{**model_config, "dtype": getattr(torch, name),
                                    "quantization": quantization}),
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device=device,
        kv_cache_space=kv_cache_space,
        num_gpu_blocks_override=override,
        parallel_config=parallel_config,
        cpu_threads_bind=cpus,
    )


def _model_config(args: EngineArgs) -> dict[str, Any]:
    """ModelConfig's fields but the dtype, from the model options: checked (the cheap ones
    first), the model found and its HF config read; quantization as the checkpoint decides
    it (the device's part comes later)."""
    from vllm_lite.models import resolve_model
    from vllm_lite.models.gguf import gguf_source
    from vllm_lite.models.gptq_awq import checkpoint_quantization
    from vllm_lite.models.loader import read_hf_config
    from vllm_lite.models.registry import get_model_class

    max_logprobs = check_int("max_logprobs", args.max_logprobs, 0)
    timeout = check_number("chat_template_timeout", args.chat_template_timeout)
    if timeout <= 0:
        raise ValueError(f"chat_template_timeout must be > 0 seconds, got {timeout}")
    max_chars = check_int("chat_template_max_chars", args.chat_template_max_chars, 1)
    quantization = check_quantization(args.quantization)
    g = args.quantization_group_size
    if g is not None:
        if quantization != "int4":
            raise ValueError("quantization_group_size is int4's; it cannot be used with "
                             f"quantization={quantization!r}")
        if isinstance(g, bool) or g not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of "
                             f"{list(INT4_GROUP_SIZES)}, got {g!r}")
    source = gguf_source(str(args.model))
    if quantization == "gguf" and source is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF model's quantized blocks, but "
                         f"model {str(args.model)!r} is not a GGUF file or an alias of one")
    # An alias (smollm2-135m) or a .gguf file becomes its converted, cached HF folder.
    path = resolve_model(str(args.model))
    model = str(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a local Hugging Face model folder (config.json)")
    # A GPTQ / AWQ checkpoint runs as such (as in vLLM); a mismatch is a ValueError.
    quantization = checkpoint_quantization(quantization, path)
    # Checks config.json's sizes; a bad file is a ValueError naming the key.
    hf_config = read_hf_config(path)
    # The architecture is one the engine runs, with settings it covers (MoE routing, GLM's
    # rotary): refused here, before a worker starts, naming the field.
    get_model_class(getattr(hf_config, "architectures", None)).check_config(hf_config)
    limit = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = int(limit) if limit else DEFAULT_MAX_MODEL_LEN
    elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
            or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
    elif limit and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    if isinstance(args.seed, bool) or not isinstance(args.seed, int):
        raise ValueError(f"seed must be an int, got {args.seed!r}")
    return dict(model=model, tokenizer=model if args.tokenizer is None else args.tokenizer,
                max_model_len=max_model_len, hf_config=hf_config, seed=args.seed,
                max_logprobs=max_logprobs, quantization=quantization,
                quantization_group_size=g, chat_template_timeout=timeout,
                chat_template_max_chars=max_chars,
                gguf_file=None if source is None else str(source),
                enforce_eager=check_bool("enforce_eager", args.enforce_eager))


# -- device ---------------------------------------------------------------------------------------
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


# -- dtype ----------------------------------------------------------------------------------------
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
    holds (float16 is emulated on CPUs, and bf16 without hardware support is no faster than
    float32 even on the AVX2 bf16 kernels: slower with GGUF weights, about even with dense
    ones); on a GPU, the checkpoint's dtype (float32 when it names none)."""
    if device_type == "cpu":
        if native_bf16 is None:
            native_bf16 = host.cpu_has_native_bf16()
        return "bfloat16" if native_bf16 else "float32"
    return ckpt_dtype or "float32"


def resolve_async_output_proc(value: Any, device_type: str, tensor_parallel_size: int) -> bool:
    """async_output_proc's on/off: "auto" is on with one GPU (the host works while it
    computes) and off on the CPU (the forward's threads use every core) or with tensor
    parallelism (the driver's collectives then run off the main thread)."""
    if not isinstance(value, str) or value not in ASYNC_OUTPUT_PROC:
        raise ValueError(f"async_output_proc must be one of {ASYNC_OUTPUT_PROC}, got {value!r}")
    if value == "auto":
        return device_type == "cuda" and tensor_parallel_size == 1
    return value == "on"


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


# -- quantization ---------------------------------------------------------------------------------
def _check_moe_quantization(model_cls: Any, hf_config: Any, quantization: str,
                            group_size: int | None, folder: str, tp_size: int) -> None:
    """A mixture-of-experts model's experts are quantized like its dense projections
    (layers/moe.py SplitExperts); what cannot run is refused here, before any weight is
    read: 4-bit groups that do not divide an expert GEMM's inputs."""
    if quantization == "int4":
        group = group_size or DEFAULT_INT4_GROUP_SIZE
    elif quantization in ("gptq", "awq"):
        from vllm_lite.models.gptq_awq import read_spec

        spec = read_spec(folder)
        group = None if spec is None else spec.group_size
    else:
        group = None
    model_cls.check_quantization(hf_config, quantization, group, tp_size)


def _is_moe(hf_config: Any) -> bool:
    from vllm_lite.models.registry import get_model_class

    architectures = getattr(hf_config, "architectures", None)
    try:
        model_cls = get_model_class(architectures)
    except ValueError:
        return False  # an unsupported architecture is refused where the model is built
    from vllm_lite.models.moe import MoeForCausalLM

    return issubclass(model_cls, MoeForCausalLM)


def resolve_quantization(requested: str | None, gguf_file: str | None, hf_config: Any,
                         device_type: str) -> str | None:
    """The method the engine runs ``requested`` (checked) with. None means the checkpoint's
    own: a GGUF model on a CPU keeps its blocks ("gguf", as vLLM runs a GGUF) when it can
    keep every projection, a mixture of experts' experts included (else they are
    dequantized, logged); off the CPU there is no int4 GEMM yet, so None
    stays None. "none" is the explicit "weights in --dtype" (None)."""
    if requested == "none":
        return None
    if requested is not None or gguf_file is None:
        return requested
    if device_type != "cpu":
        return requested
    from vllm_lite.models.gguf_quant import why_not_kept

    reason = why_not_kept(gguf_file, int(hf_config.num_hidden_layers))
    if reason is not None:
        logger.debug("quantization: none (a GGUF whose blocks cannot all be kept: %s)", reason)
        return None
    logger.debug("quantization: gguf (the GGUF's quantized blocks kept; quantization='none' "
                 "dequantizes them)")
    return "gguf"
