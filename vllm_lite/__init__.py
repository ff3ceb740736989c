"""vllm_lite: a compact LLM inference engine.

Importing the package loads the native extension vllm_lite._C, which registers the
kernels as torch.ops.vllm_lite.*. The typed wrappers live in vllm_lite.ops.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logger = logging.getLogger(__name__)

try:
    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    from vllm_lite import _C  # noqa: F401
except ImportError as e:  # the pure-Python parts (core/) stay importable without it
    _C = None
    _C_IMPORT_ERROR: ImportError | None = e
    logger.debug("vllm_lite._C not loaded: %s", e)
else:
    _C_IMPORT_ERROR = None


# Lazy exports: `import vllm_lite` stays cheap (no transformers, no model code) until one
# of these is used.
_LAZY = {
    "LLM": "vllm_lite.entrypoints.llm",
    "SamplingParams": "vllm_lite.sampling_params",
    "RequestOutputKind": "vllm_lite.sampling_params",
    "RequestOutput": "vllm_lite.outputs",
    "CompletionOutput": "vllm_lite.outputs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_lite' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
