"""RMSNorm, rounded exactly as Hugging Face's LlamaRMSNorm (float32 statistics), through the
native ``rms_norm`` / ``fused_add_rms_norm`` ops (one kernel instead of eight torch ops)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_lite import ops


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)).

    The normalization runs in float32 and is cast back to the input dtype *before* the
    weight multiply, the order HF uses, so half-precision outputs round the same way.

    ``forward(x)`` returns the normalized x. ``forward(x, residual)`` is the decoder's
    "add, then normalize" step: it returns (norm(x + residual), x + residual) with the sum
    rounded to the dtype first (HF's ``hidden = residual + x``), computed in place in x's
    and residual's memory: both must be contiguous tensors the caller owns.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        # The op takes rows at one stride; per-head views of a fused projection (Qwen3's
        # q/k norms) are not, and reshape copies only those.
        rows = x.reshape(-1, x.shape[-1])
        return ops.rms_norm(rows, self.weight, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
