"""Models (Llama family), their registry and the HF-folder weight loader."""

from vllm_lite.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from vllm_lite.models.loader import iterate_weights, load_model
from vllm_lite.models.registry import get_model_class, supported_architectures

__all__ = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "iterate_weights",
    "load_model",
    "supported_architectures",
]
