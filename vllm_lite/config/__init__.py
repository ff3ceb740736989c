"""Engine configuration, one concept a module:

- ``args``: ``EngineArgs``, every option a user sets (LLM keywords, CLI flags, help text);
- ``schema``: the frozen configs the engine runs with, named as the options, and their
  defaults (a leaf: models, layers and core import only this);
- ``resolve``: the one step from ``EngineArgs`` to ``EngineConfig`` (HF config, device,
  dtype, quantization);
- ``host``: the machine (memory, CPU features, CPU affinity) and torch's threads.

``from vllm_lite.config import X`` works for every public name below; a name loads its
module on first use, so importing ``vllm_lite.config.schema`` (models, core) does not load
the CLI or the resolver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "schema": (
        "GiB", "DEFAULT_MODEL", "DEFAULT_MAX_LOGPROBS", "DEFAULT_MAX_MODEL_LEN", "DTYPE_NAMES",
        "QUANTIZATION_METHODS", "QUANTIZATION_CHOICES", "INT4_GROUP_SIZES",
        "DEFAULT_INT4_GROUP_SIZE", "KV_CACHE_DTYPES", "POLICIES", "PREEMPTION_MODES",
        "SchedulerPolicy", "PreemptionMode", "check_int", "check_number", "check_bool",
        "check_quantization", "kv_cache_block_bytes", "CacheConfig", "SchedulerConfig",
        "ModelConfig", "ParallelConfig", "EngineConfig",
    ),
    "args": ("EngineArgs", "THREADS_HELP", "device_name"),
    "resolve": ("create_engine_config", "resolve_device", "checkpoint_dtype", "auto_dtype",
                "resolve_dtype_name", "resolve_quantization"),
    "host": ("total_memory_bytes", "cpu_flags", "cpu_has_native_bf16", "parse_cpu_ids",
             "set_threads"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_lite.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vllm_lite.config.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from vllm_lite.config.args import THREADS_HELP, EngineArgs, device_name  # noqa: F401
    from vllm_lite.config.host import (  # noqa: F401
        cpu_flags, cpu_has_native_bf16, parse_cpu_ids, set_threads, total_memory_bytes)
    from vllm_lite.config.resolve import (  # noqa: F401
        auto_dtype, checkpoint_dtype, create_engine_config, resolve_device,
        resolve_dtype_name, resolve_quantization)
    from vllm_lite.config.schema import *  # noqa: F401,F403
