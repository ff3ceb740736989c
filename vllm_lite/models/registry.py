"""Architecture name (HF ``config.architectures``) -> model class."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from vllm_lite.models.glm import Glm4ForCausalLM, GlmForCausalLM
from vllm_lite.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from vllm_lite.models.moe import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: str | Sequence[str] | None) -> type[nn.Module]:
    """The class for the first supported name in ``architectures``.

    Raises ValueError listing the supported architectures when none is.
    """
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(
        f"model architecture(s) {names or '(none given in config.architectures)'} not "
        f"supported; supported: {', '.join(supported_architectures())}"
    )
