"""Models (Llama family), their registry, the HF-folder weight loader and GGUF / alias
resolution (``resolve_model``)."""

from vllm_lite.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from vllm_lite.models.loader import DEFAULT_MODEL, iterate_weights, load_model, resolve_model
from vllm_lite.models.registry import get_model_class, supported_architectures

__all__ = [
    "DEFAULT_MODEL",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "iterate_weights",
    "load_model",
    "resolve_model",
    "supported_architectures",
]
