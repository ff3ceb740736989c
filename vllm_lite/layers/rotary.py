"""Rotary position embedding (HF "rotate_half" / GPT-NeoX layout).

The cos/sin table is precomputed once for every position up to ``max_position`` and
indexed by each token's position inside the native ``rotary_embedding`` op, so a flat
batch of tokens from many sequences (each at its own offset) is rotated in one call, with
no per-sequence work.

Layouts: HF's rotate_half (GPT-NeoX: pairs (i, i + rot_dim / 2); Llama, Qwen, ...) or
the interleaved one (GPT-J: pairs (2i, 2i + 1); GLM), over the first ``rotary_dim``
features of each head (all of them but for a partial rotary, as GLM's half), the rest
passing through unchanged.

Supported ``rope_type``s: ``default``, ``linear``, ``llama3`` (HF's formulas, bit for bit
in float32) and ``dynamic``. ``dynamic`` (NTK) in HF recomputes the frequencies from the
*current* sequence length once it exceeds ``max_position_embeddings``; below that it is
the default rotary, which is what we implement. Positions past the table are an error
(the engine caps ``max_model_len`` at ``max_position_embeddings``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from vllm_lite import ops

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 stores them in ``config.rope_parameters``; older versions in
    ``config.rope_theta`` plus an optional ``config.rope_scaling`` (whose type key was
    once called ``type``). Both are accepted so configs from either era load.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def compute_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_size // 2] in float32, following transformers'
    ``modeling_rope_utils`` for the supported rope types; ``head_size`` is the rotated
    dimension (a model with a partial rotary passes its rotary_dim and no
    ``partial_rotary_factor``)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    base = float(params["rope_theta"])
    # Same expression as HF (int64 arange cast to float) so the table matches bitwise.
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float) / head_size)
    )
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between
        # interpolated smoothly.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k of a flat token batch.

    The table is a float32, non-persistent buffer [max_position, rotary_dim] (cos in the
    first half, sin in the second): float32 whatever the model dtype, as HF computes
    cos/sin in float32 and casts them to the activation dtype. ``head_size``: the heads'
    size; ``rotary_dim`` (default all of it): how many leading features of each head
    rotate; ``is_neox``: rotate_half pairs, else interleaved ones (see the module doc).
    """

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any],
                 rotary_dim: int | None = None, is_neox: bool = True) -> None:
        super().__init__()
        rotary_dim = head_size if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary dimension must be even and in (0, head_size "
                             f"{head_size}], got {rotary_dim}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        inv_freq = compute_inv_freq(rotary_dim, params)
        t = torch.arange(max_position, dtype=torch.int64).to(torch.float)
        freqs = t[:, None] * inv_freq[None, :]  # HF: position.float() * inv_freq, in float32
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Keep the table float32 when the model is cast (model.to(torch.bfloat16)): a bf16
        # table would lose position precision. Device moves still apply.
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q [T, num_heads(, )head_size] and k [T, num_kv_heads(, )head_size] in
        place (any token stride: slices of a fused qkv projection), positions int64 [T],
        with the native ``rotary_embedding`` op: HF's rounding, the float32 table cast to
        q's dtype as HF casts cos / sin."""
        ops.rotary_embedding(positions, q, k, self.head_size, self.cos_sin_cache, self.is_neox)

    def extra_repr(self) -> str:
        partial = "" if self.rotary_dim == self.head_size else f", rotary_dim={self.rotary_dim}"
        return (f"head_size={self.head_size}{partial}, is_neox={self.is_neox}, "
                f"max_position={self.max_position}, rope_type={self.rope_type}")

