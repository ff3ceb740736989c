"""Engine configuration: the options a user sets (``EngineArgs``), the configs the engine
runs with, and the one step from the first to the second.

``from vllm_lite.config import X`` keeps working for every public name; the modules below
are where each lives.
"""

from vllm_lite.config.args import (
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL,
    DTYPE_NAMES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_METHODS,
    THREADS_HELP,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    GiB,
    ModelConfig,
    ParallelConfig,
    PreemptionMode,
    SchedulerConfig,
    SchedulerPolicy,
    auto_dtype,
    check_bool,
    check_int,
    check_number,
    check_quantization,
    checkpoint_dtype,
    cpu_flags,
    cpu_has_native_bf16,
    device_name,
    kv_cache_block_bytes,
    parse_cpu_ids,
    resolve_device,
    resolve_dtype_name,
    resolve_quantization,
    set_threads,
    total_memory_bytes,
)

__all__ = [
    "DEFAULT_INT4_GROUP_SIZE", "DEFAULT_MAX_LOGPROBS", "DEFAULT_MAX_MODEL_LEN", "DEFAULT_MODEL",
    "DTYPE_NAMES", "INT4_GROUP_SIZES", "KV_CACHE_DTYPES", "QUANTIZATION_CHOICES",
    "QUANTIZATION_METHODS", "THREADS_HELP", "CacheConfig", "EngineArgs", "EngineConfig", "GiB",
    "ModelConfig", "ParallelConfig", "PreemptionMode", "SchedulerConfig", "SchedulerPolicy",
    "auto_dtype", "check_bool", "check_int", "check_number", "check_quantization",
    "checkpoint_dtype", "cpu_flags", "cpu_has_native_bf16", "device_name",
    "kv_cache_block_bytes", "parse_cpu_ids", "resolve_device", "resolve_dtype_name",
    "resolve_quantization", "set_threads", "total_memory_bytes",
]
