"""Model building blocks: attention (+ per-step metadata), rotary embedding, RMSNorm.

The sampler (``vllm_lite.layers.sampler``) lives here too but is imported on its own.
"""

from vllm_lite.layers.attention import (
    Attention,
    AttentionMetadata,
    attention_metadata,
    get_attention_metadata,
    set_attention_metadata,
)
from vllm_lite.layers.layernorm import RMSNorm
from vllm_lite.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "AttentionMetadata",
    "RMSNorm",
    "RotaryEmbedding",
    "attention_metadata",
    "get_attention_metadata",
    "set_attention_metadata",
]
