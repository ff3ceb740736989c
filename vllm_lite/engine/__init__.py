"""The engine: the step loop over scheduler, cache engine, model runner and sampler."""

from vllm_lite.config.schema import EngineConfig, ModelConfig
from vllm_lite.engine.llm_engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine", "ModelConfig"]
