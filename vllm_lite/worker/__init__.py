"""Device-side pieces of the engine: the KV cache engine and the model runner."""

from vllm_lite.worker.cache_engine import CacheEngine
from vllm_lite.worker.model_runner import ModelRunner

__all__ = ["CacheEngine", "ModelRunner"]
