"""GLM (``GlmForCausalLM``, GLM-4-9B's layout) and GLM-4 (``Glm4ForCausalLM``, GLM-4-0414's).

Llama's layers with GLM's details (HF ``modeling_glm.py`` / ``modeling_glm4.py``):

- a partial, interleaved rotary: the first ``head_dim * partial_rotary_factor`` features
  of each head rotate in GPT-J pairs (2i, 2i + 1), the rest pass through
  (``RotaryEmbedding(rotary_dim=..., is_neox=False)``);
- q/k/v biased by ``attention_bias``, o_proj never;
- the checkpoint's MLP is one ``gate_up_proj`` [gate | up], our fused layout already: it
  loads as its two halves, so tensor parallelism cuts it as Llama's gate and up;
- GLM-4 adds two RMSNorms per layer: ``post_self_attn_layernorm`` on the attention output
  and ``post_mlp_layernorm`` on the MLP output, each before its residual add.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_lite.layers.layernorm import RMSNorm
from vllm_lite.layers.rotary import RotaryEmbedding, rope_parameters_of
from vllm_lite.models.llama import (
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    _head_dim,
)


def _partial_rotary_factor(config: Any, params: dict[str, Any]) -> float:
    # transformers >= 5 keeps it in rope_parameters; older configs at the top level.
    factor = params.pop("partial_rotary_factor", None)
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    return 1.0 if factor is None else factor


class GlmForCausalLM(LlamaForCausalLM):
    """GLM: partial interleaved rotary, q/k/v bias, fused gate_up in the checkpoint."""

    @classmethod
    def check_config(cls, config: Any) -> None:
        params = rope_parameters_of(config)
        factor = _partial_rotary_factor(config, params)
        head_dim = _head_dim(config)
        if (isinstance(factor, bool) or not isinstance(factor, (int, float))
                or not 0 < factor <= 1):
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got "
                             f"{factor!r}")
        rotary_dim = int(head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {factor} of head_dim {head_dim} gives "
                             f"{rotary_dim} rotary features; it must be an even number >= 2")

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", True)))

    @classmethod
    def rotary_embedding(cls, config: Any, max_position: int) -> RotaryEmbedding:
        params = rope_parameters_of(config)
        head_dim = _head_dim(config)
        rotary_dim = int(head_dim * _partial_rotary_factor(config, params))
        return RotaryEmbedding(head_dim, max_position, params, rotary_dim=rotary_dim,
                               is_neox=False)

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        return None  # GLM has none

    def _checkpoint_targets(self, hf_name: str, tensor: torch.Tensor
                            ) -> list[tuple[str, Any, torch.Tensor]]:
        if hf_name.endswith(".mlp.gate_up_proj.weight"):
            if tensor.dim() != 2 or tensor.shape[0] % 2:
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} is "
                                 f"not [2 * intermediate_size, hidden_size]")
            gate, up = tensor.chunk(2, dim=0)
            return [(hf_name, 0, gate), (hf_name, 1, up)]
        return super()._checkpoint_targets(hf_name, tensor)


class Glm4DecoderLayer(LlamaDecoderLayer):
    """A GLM-4 layer: Llama's, with an RMSNorm on each sublayer's output."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # LlamaDecoderLayer.forward's contract; the post-norms apply to each sublayer's
        # output before it joins the residual stream (fused into the next norm's add).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4 (0414): GLM with the post-attention and post-MLP norms."""

    decoder_layer_cls = Glm4DecoderLayer
