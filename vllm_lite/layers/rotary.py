"""Rotary position embedding (HF "rotate_half" / GPT-NeoX layout).

The cos/sin table is precomputed once for every position up to ``max_position`` and
indexed by each token's position, so a flat batch of tokens from many sequences (each at
its own offset) is rotated in one gather, with no per-sequence work.

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
    ``modeling_rope_utils`` for the supported rope types."""
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

    The table is a float32, non-persistent buffer [max_position, head_size] (cos in the
    first half, sin in the second): float32 whatever the model dtype, as HF computes
    cos/sin in float32 and casts them to the activation dtype.
    """

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        inv_freq = compute_inv_freq(head_size, params)
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

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_size], k: [T, num_kv_heads, head_size]; positions [T]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each token's position, [T, 1, head_size / 2] in ``dtype``. The
        same for every layer: a model gathers them once per forward and passes them to
        :meth:`rotate` in each layer (one gather and cast instead of one per layer)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, head_size] (any number of heads: q and k side by side in
        one call rotate exactly as apart) with :meth:`cos_sin`'s tables."""
        return _rotate(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}, rope_type={self.rope_type}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), written on the halves.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
