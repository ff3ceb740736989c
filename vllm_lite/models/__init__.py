"""Models (Llama family, GLM, the mixture-of-experts models), their registry, the
HF-folder weight loader and GGUF / alias resolution (``resolve_model``)."""

from vllm_lite.models.glm import Glm4ForCausalLM, GlmForCausalLM
from vllm_lite.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from vllm_lite.models.loader import DEFAULT_MODEL, iterate_weights, load_model, resolve_model
from vllm_lite.models.moe import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from vllm_lite.models.registry import get_model_class, supported_architectures

__all__ = [
    "DEFAULT_MODEL",
    "Glm4ForCausalLM",
    "GlmForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "get_model_class",
    "iterate_weights",
    "load_model",
    "resolve_model",
    "supported_architectures",
]
