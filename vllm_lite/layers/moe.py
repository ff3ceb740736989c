"""Mixture-of-experts feed-forward block: a router picks ``top_k`` of ``num_experts`` SwiGLU
experts per token and the block returns their outputs' weighted sum.

One function does the whole block's arithmetic, :func:`fused_moe`: the native op
``torch.ops.vllm_lite.fused_moe`` (csrc/cpu/fused_moe.cpp, csrc/cuda/moe/), whose schema is

    fused_moe(Tensor hidden, Tensor router_logits, Tensor w13, Tensor w2, int top_k,
              bool renormalize) -> Tensor

- ``hidden`` [T, H] (float32, float16 or bfloat16; rows contiguous);
- ``router_logits`` [T, E], any float dtype (the router GEMM's output, in the model's
  dtype as HF computes it);
- ``w13`` [E, 2I, H]: each expert's [gate | up] rows, the dense MLP's gate_up layout;
- ``w2`` [E, H, I]: each expert's down projection;
- returns [T, H] in ``hidden``'s dtype.

Routing (:func:`select_experts`, the models' shared normalisation): softmax over the E
logits in float32, the ``top_k`` largest probabilities (the op breaks ties to the lower
expert id; torch.topk, which :func:`select_experts` uses, leaves their order unspecified, so
on exactly tied probabilities the two may route differently), divided by their sum when
``renormalize`` (Mixtral always; Qwen-MoE and OLMoE when ``norm_topk_prob``). The experts:
tokens grouped by expert (a stable sort of the T * top_k (token, expert) pairs), per expert
one GEMM of its rows by its gate_up, SiLU-and-mul, one GEMM by its down projection; each row
times its routing weight (float32), summed back into its token's row in float32 and rounded
once to the dtype. An expert no token chose costs nothing. :func:`fused_moe_torch` is the
same math in torch ops, the readable statement of the contract and the op's peer in
benchmarks/moe.py.

On the CPU, :meth:`FusedMoE.prepare_for_cpu` packs the experts' weights at load
(``ops.pack_moe_weights``) where the selected CPU build runs packed_linear's kernels for the
dtype (AVX-512 float32, AVX512-BF16 / AMX bfloat16); elsewhere the op takes the weights as
they are and runs each expert's GEMMs through ATen.

Weight quantization (vllm_lite.layers.quantization.quantize_model) replaces a layer's
:class:`FusedMoE` by :meth:`FusedMoE.split`'s :class:`SplitExperts`: one module per expert
whose two projections are linear layers it then quantizes like the dense ones; its forward
is :func:`grouped_experts` (the same routing and grouping, one call of each quantized
projection per expert some token chose).

Limits (:data:`MAX_NUM_EXPERTS`, :data:`MAX_TOP_K`) are what the kernels promise to cover;
:func:`check_moe_config` refuses a model past them when it loads, naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import ops
from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.distributed.layers import Shard, all_reduce
from vllm_lite.errors import InternalError

#: The most experts a layer may have (the kernels' limit, csrc/moe_limits.h).
MAX_NUM_EXPERTS = ops.MOE_MAX_NUM_EXPERTS
#: The most experts a token may be routed to (likewise).
MAX_TOP_K = ops.MOE_MAX_TOP_K


def _check_count(field: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"config field {field} must be an int in [1, {limit}], got {value!r}")
    return value


def check_moe_config(num_experts: tuple[str, Any], top_k: tuple[str, Any],
                     intermediate_size: tuple[str, Any],
                     renormalize: tuple[str, Any] | None = None) -> None:
    """The MoE settings of a config, each given as (field name, value): ValueError naming
    the field for one the MoE layer cannot run (a count past the limits, top_k above the
    expert count, a size that is not a positive int, a normalisation flag that is not a
    bool). Models call it before building anything."""
    experts = _check_count(num_experts[0], num_experts[1], MAX_NUM_EXPERTS)
    k = _check_count(top_k[0], top_k[1], MAX_TOP_K)
    if k > experts:
        raise ValueError(f"config field {top_k[0]} ({k}) exceeds {num_experts[0]} ({experts}): "
                         f"a token cannot be routed to more experts than there are")
    name, size = intermediate_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"config field {name} must be a positive int, got {size!r}")
    if renormalize is not None and not isinstance(renormalize[1], bool):
        raise ValueError(f"config field {renormalize[0]} must be true or false (whether the "
                         f"top-k routing weights are renormalised), got {renormalize[1]!r}")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]): softmax of the logits in
    float32, its top_k, renormalised to sum 1 when ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The MoE block's output [T, H] (see the module doc for the contract): the native op.
    On the CPU ``w13`` / ``w2`` may be ``ops.pack_moe_weights``'."""
    return ops.fused_moe(hidden, router_logits, w13, w2, top_k, renormalize)


def fused_moe_torch(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """:func:`fused_moe` in torch ops (unpacked weights): routing, grouped expert GEMMs,
    weighted sum in token order."""
    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(ops.silu_and_mul(F.linear(x, w13[e])), w2[e])

    return grouped_experts(hidden, router_logits, top_k, renormalize, w13.shape[0],
                           w2.shape[1], expert)


def grouped_experts(hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                    renormalize: bool, num_experts: int, hidden_out: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The MoE block's arithmetic around per-expert calls: :func:`select_experts`' routing,
    the (token, slot) pairs grouped by expert (a stable sort), ``expert(e, rows)`` [n, H] ->
    [n, ``hidden_out``] once per expert some token chose, each row times its routing weight
    and summed into its token's row in float32, rounded once to ``hidden``'s dtype."""
    tokens = hidden.shape[0]
    out = torch.zeros(tokens, hidden_out, dtype=torch.float32, device=hidden.device)
    if tokens == 0:
        return out.to(hidden.dtype)
    weights, ids = select_experts(router_logits, top_k, renormalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    rows = hidden.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    expert_out = torch.empty(rows.shape[0], hidden_out, dtype=hidden.dtype,
                             device=hidden.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        expert_out[start:start + n] = expert(e, rows[start:start + n])
        start += n
    weighted = expert_out.float() * weights.reshape(-1)[order].unsqueeze(1)
    out.index_add_(0, order // top_k, weighted)
    return out.to(hidden.dtype)


class Router(nn.Module):
    """A small replicated projection without bias (the router's [E, H], the shared
    expert's sigmoid gate [1, H]): not an nn.Linear, so weight quantization leaves it in
    the model's dtype (a quantized router would route tokens differently)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """A layer's routed experts' weights: ``w13_weight`` [E, 2I, H] and ``w2_weight``
    [E, H, I], I being this rank's slice of the experts' intermediate features under
    tensor parallelism (cut as the dense MLP's: each rank returns a partial sum)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.full_intermediate_size = intermediate_size
        self.intermediate_start, self.intermediate_size = Shard.of(tp).range(intermediate_size)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size,
                                                   hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                                  self.intermediate_size))

    _packed: tuple[torch.Tensor, torch.Tensor] | None = None  # ops.pack_moe_weights'

    def prepare_for_cpu(self) -> None:
        """Packs the experts' weights for the CPU kernel where the selected build runs
        packed_linear's kernels for their dtype (bfloat16: H and I even); run at load, again
        after changing weights. The parameters stay as they are (state_dict, other devices)."""
        self._packed = None
        w13, w2 = self.w13_weight, self.w2_weight
        if (w13.device.type != "cpu" or not ops.packed_linear_kernel_selected(w13.dtype)
                or (w13.dtype == torch.bfloat16 and (w13.shape[2] % 2 or w2.shape[2] % 2))):
            return
        with torch.no_grad():
            self._packed = ops.pack_moe_weights(w13.detach(), w2.detach())

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13_weight, self.w2_weight
        if (self._packed is not None and hidden.device.type == "cpu"
                and hidden.dtype == w13.dtype and not torch.is_grad_enabled()):
            w13, w2 = self._packed
        return fused_moe(hidden.contiguous(), router_logits.contiguous(), w13, w2, self.top_k,
                         self.renormalize)

    def split(self) -> SplitExperts:
        """The same experts one module per expert (:class:`SplitExperts`), their
        projections plain nn.Linear layers viewing this layer's weights (no copy): the form
        weight quantization replaces projection by projection."""
        return SplitExperts(self)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}")


def _linear_viewing(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear without bias whose weight is ``weight`` itself (a view, not a copy)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class ExpertMLP(nn.Module):
    """One routed expert: ``gate_up_proj`` [2I, H] (gate rows, then up), SiLU-and-mul,
    ``down_proj`` [H, I]; nn.Linear, or the quantized layers that replace them
    (vllm_lite.layers.quantization)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class SplitExperts(nn.Module):
    """A layer's routed experts as children ``"0"`` ... ``"E-1"``, each an
    :class:`ExpertMLP`, so that each expert's projections are ordinary (quantizable) linear
    layers named ``experts.{e}.gate_up_proj`` / ``down_proj``, as the dense MLP's.

    The arithmetic is :func:`fused_moe`'s contract run by :func:`grouped_experts`: the same
    routing and grouping, then per expert some token chose its two projections' GEMMs on
    its rows only (one call each; an expert no token chose costs nothing), whatever GEMM
    those layers run (int8_linear, int4_linear, ATen)."""

    def __init__(self, moe: FusedMoE) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.hidden_size = moe.w2_weight.shape[1]
        self.full_intermediate_size = moe.full_intermediate_size
        self.intermediate_start = moe.intermediate_start
        self.intermediate_size = moe.intermediate_size
        for e in range(self.num_experts):
            self.add_module(str(e), ExpertMLP(_linear_viewing(moe.w13_weight[e]),
                                              _linear_viewing(moe.w2_weight[e])))
        # The children by index, looked up once (quantization swaps their projections,
        # not them).
        self._by_index: list[ExpertMLP] = [self.get_submodule(str(e))  # type: ignore[misc]
                                           for e in range(self.num_experts)]

    def expert(self, e: int) -> ExpertMLP:
        return self._by_index[e]

    def fused(self, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
        """These experts as one :class:`FusedMoE` again, on plain weights w13 [E, 2I, H] and
        w2 [E, H, I] (what a quantization that dequantizes at load left of each expert's
        projections), so that the fused op runs them instead of a GEMM per expert."""
        with torch.device("meta"):  # no allocation: the weights are given
            moe = FusedMoE(self.hidden_size, self.num_experts, self.top_k,
                           self.full_intermediate_size, self.renormalize)
        moe.intermediate_start, moe.intermediate_size = (self.intermediate_start,
                                                         self.intermediate_size)
        want13 = (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        want2 = (self.num_experts, self.hidden_size, self.intermediate_size)
        if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
            raise InternalError(f"fused experts' weights {tuple(w13.shape)}, "
                                f"{tuple(w2.shape)}: expected {want13}, {want2}")
        moe.w13_weight = nn.Parameter(w13, requires_grad=False)
        moe.w2_weight = nn.Parameter(w2, requires_grad=False)
        return moe

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        experts = self._by_index
        return grouped_experts(hidden, router_logits, self.top_k, self.renormalize,
                               self.num_experts, self.hidden_size,
                               lambda e, x: experts[e](x))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}")


class SparseMoeBlock(nn.Module):
    """The feed-forward block of an MoE layer: ``gate`` (the router), ``experts``
    (:class:`FusedMoE`, or :class:`SplitExperts` once quantized) and, for Qwen2-MoE, a
    ``shared_expert`` (a dense MLP every token runs, built by the model with reduce=False)
    scaled by ``sigmoid(shared_expert_gate(x))`` and added. Under tensor parallelism one
    all-reduce sums the ranks' partial outputs."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool,
                 tp: TensorParallelGroup | None = None,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedMoE(hidden_size, num_experts, top_k, intermediate_size,
                                renormalize, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return all_reduce(self.tp, out)
