"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Llama-family attention (:mod:`vllm_lite.models.llama`) with the feed-forward block of
every (or, for the Qwen MoEs, some) layer a :class:`~vllm_lite.layers.moe.SparseMoeBlock`.
What differs, from each model's HF ``modeling_*.py``:

=============  ===========================  ==========================  =======================
model          experts / intermediate       routing weights             attention
=============  ===========================  ==========================  =======================
Mixtral        num_local_experts /          top-k renormalised          Mistral's
               intermediate_size
Qwen2-MoE      num_experts /                renormalised if             Qwen2's (qkv_bias),
               moe_intermediate_size,       norm_topk_prob              dense MLP on
               + shared expert, sigmoid                                 mlp_only_layers and
               gate                                                     off decoder_sparse_step
Qwen3-MoE      num_experts /                as Qwen2-MoE                Qwen3's (q/k head
               moe_intermediate_size                                    norms); as Qwen2-MoE
OLMoE          num_experts /                as Qwen2-MoE                q/k RMSNorm over all
               intermediate_size                                        heads, clip_qkv,
                                                                        attention_bias on all
=============  ===========================  ==========================  =======================

Every model checks its MoE settings (:meth:`MoeForCausalLM.check_config`, and
:meth:`MoeForCausalLM.check_quantization` for a 4-bit weight quantization's groups) before
anything is allocated or read. Quantized, each expert's projections are layers of their own
(``mlp.experts.{e}.gate_up_proj`` / ``down_proj``, layers/moe.py SplitExperts), which GPTQ /
AWQ checkpoints fill from their per-expert tensors (models/gptq_awq.py). Checkpoints store
each expert's projections separately (HF naming:
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``); transformers 5's in-memory layout
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) loads too.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.layers.moe import FusedMoE, SparseMoeBlock, check_moe_config
from vllm_lite.models.llama import (
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# An expert's projection once the experts are split for quantization (layers/moe.py).
_EXPERT_PROJECTION = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.\d+\.(?P<proj>gate_up_proj|down_proj)$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class MoeDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose feed-forward block the model class decides
    (:meth:`MoeForCausalLM.mlp_for`)."""

    model_cls: ClassVar[type[MoeForCausalLM]]

    def make_mlp(self, config: Any, opts: LayerOptions, tp: TensorParallelGroup | None,
                 layer_idx: int) -> nn.Module:
        return self.model_cls.mlp_for(config, opts, tp, layer_idx)


class MoeForCausalLM(LlamaForCausalLM):
    """The MoE models' shared part: config checks, the per-layer block choice, and the
    expert weights' loading (per expert, or transformers 5's fused 3-D tensors) and
    tensor-parallel slicing. Subclasses name their config fields."""

    num_experts_field: ClassVar[str] = "num_experts"
    intermediate_field: ClassVar[str] = "moe_intermediate_size"
    # None: always renormalised (Mixtral); else the bool field that says so.
    renormalize_field: ClassVar[str | None] = "norm_topk_prob"
    # Checkpoint names of an expert's (gate, up, down) projections.
    expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    has_shared_expert: ClassVar[bool] = False
    # Whether decoder_sparse_step / mlp_only_layers choose dense layers (the Qwen MoEs).
    has_dense_layers: ClassVar[bool] = False
    # The CUDA fused_moe needs no host round trip, but no GPU has yet run it under graph
    # capture: eager until one does.
    supports_cuda_graphs: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.decoder_layer_cls = type(f"{cls.__name__}DecoderLayer", (MoeDecoderLayer,),
                                     {"model_cls": cls, "__module__": cls.__module__})

    # -- config -------------------------------------------------------------------------
    @classmethod
    def check_config(cls, config: Any) -> None:
        renormalize = (None if cls.renormalize_field is None else
                       (cls.renormalize_field, getattr(config, cls.renormalize_field, False)))
        check_moe_config((cls.num_experts_field, getattr(config, cls.num_experts_field, None)),
                         ("num_experts_per_tok", getattr(config, "num_experts_per_tok", None)),
                         (cls.intermediate_field, getattr(config, cls.intermediate_field, None)),
                         renormalize)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config field hidden_act {act!r} is not supported (only 'silu')")
        scoring = getattr(config, "scoring_func", None)
        if scoring not in (None, "softmax"):
            raise ValueError(f"config field scoring_func {scoring!r}: the router's normalisation "
                             f"must be 'softmax' (softmax, then top-k)")
        if cls.has_shared_expert:
            size = getattr(config, "shared_expert_intermediate_size", None)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"config field shared_expert_intermediate_size must be a "
                                 f"positive int, got {size!r}")
        if cls.has_dense_layers:
            step = getattr(config, "decoder_sparse_step", 1)
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"config field decoder_sparse_step must be a positive int, "
                                 f"got {step!r}")
            dense = getattr(config, "mlp_only_layers", None) or []
            layers = config.num_hidden_layers
            if not isinstance(dense, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                    for i in dense):
                raise ValueError(f"config field mlp_only_layers must list layer indices in "
                                 f"[0, {layers}), got {dense!r}")

    @classmethod
    def check_quantization(cls, config: Any, method: str | None, group_size: int | None,
                           tp_size: int = 1) -> None:
        """Before any weight is read: a 4-bit ``method`` (int4, gptq, awq: groups of
        ``group_size`` consecutive inputs share a scale) needs every expert GEMM's inputs to
        hold whole groups: ``hidden_size`` (gate / up) and each rank's share of the experts'
        intermediate size (down), likewise the shared expert's and the dense layers'
        MLPs. ValueError naming the fields otherwise. (GGUF's blocks are whole by
        construction; int8 has none.)"""
        if method not in ("int4", "gptq", "awq") or group_size is None:
            return
        what = ("quantization_group_size" if method == "int4"
                else f"the {method} checkpoint's quantization_config.group_size")
        fields = [("hidden_size", 1), (cls.intermediate_field, tp_size)]
        if cls.has_shared_expert:
            fields.append(("shared_expert_intermediate_size", tp_size))
        if cls.has_dense_layers and any(not cls.is_sparse(config, i)
                                        for i in range(config.num_hidden_layers)):
            fields.append(("intermediate_size", tp_size))
        for field, ranks in fields:
            size = getattr(config, field)
            if (size // ranks) % group_size:
                per_rank = (f" / tensor_parallel_size {ranks} = {size // ranks} per rank"
                            if ranks > 1 else "")
                raise ValueError(f"{what} ({group_size}) must divide the model's {field} "
                                 f"({size}{per_rank}): the {method} weights' groups run along "
                                 f"those inputs")

    @classmethod
    def renormalize(cls, config: Any) -> bool:
        return True if cls.renormalize_field is None else bool(
            getattr(config, cls.renormalize_field, False))

    @classmethod
    def is_sparse(cls, config: Any, layer_idx: int) -> bool:
        if not cls.has_dense_layers:
            return True
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)

    @classmethod
    def mlp_for(cls, config: Any, opts: LayerOptions, tp: TensorParallelGroup | None,
                layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s block: experts, or the dense MLP where the config says."""
        if not cls.is_sparse(config, layer_idx):
            return LlamaMLP(config, opts, tp)
        shared = (LlamaMLP(config, opts, tp, config.shared_expert_intermediate_size,
                           reduce=False) if cls.has_shared_expert else None)
        return SparseMoeBlock(config.hidden_size, getattr(config, cls.num_experts_field),
                              config.num_experts_per_tok,
                              getattr(config, cls.intermediate_field), cls.renormalize(config),
                              tp, shared)

    # -- weights ------------------------------------------------------------------------
    def prepare_for_cpu(self) -> None:
        """The dense projections' packing (LlamaForCausalLM), and the experts' for the CPU
        fused_moe kernel (:meth:`FusedMoE.prepare_for_cpu`)."""
        super().prepare_for_cpu()
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.prepare_for_cpu()

    def tp_segments(self, module: str) -> tuple[int, list[tuple[int, int]]] | None:
        """As the dense MLP's, for an expert's projection too (``...experts.{e}.gate_up_proj``
        / ``down_proj``): every expert is cut like the layer's experts module says."""
        m = _EXPERT_PROJECTION.match(module)
        if m:
            module = f"{m['prefix']}.{m['proj']}"  # its parent: the layer's experts module
        return super().tp_segments(module)

    def _num_experts(self) -> int:
        return getattr(self.config, self.num_experts_field)

    def _shards_of(self, name: str) -> tuple[Any, ...]:
        if name.endswith(".experts.w13_weight"):
            return tuple((e, p) for e in range(self._num_experts()) for p in (0, 1))
        if name.endswith(".experts.w2_weight"):
            return tuple((e, None) for e in range(self._num_experts()))
        return super()._shards_of(name)

    @classmethod
    def checkpoint_name(cls, hf_name: str) -> str:
        """A checkpoint name in our modules' naming (Mixtral renames its block)."""
        return hf_name

    def _checkpoint_targets(self, hf_name: str, tensor: torch.Tensor
                            ) -> list[tuple[str, Any, torch.Tensor]]:
        name = self.checkpoint_name(hf_name)
        num_experts = self._num_experts()
        m = _EXPERT.match(name)
        if m and m["proj"] in self.expert_projections and int(m["e"]) < num_experts:
            part = self.expert_projections.index(m["proj"])
            e = int(m["e"])
            if part == 2:
                return [(m["prefix"] + ".w2_weight", (e, None), tensor)]
            return [(m["prefix"] + ".w13_weight", (e, part), tensor)]
        m = _FUSED_EXPERTS.match(name)
        if m:
            if tensor.dim() != 3 or tensor.shape[0] != num_experts or (
                    m["proj"] == "gate_up_proj" and tensor.shape[1] % 2):
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} is "
                                 f"not [{self.num_experts_field} ({num_experts}), ...] of "
                                 f"{'[gate | up]' if m['proj'] == 'gate_up_proj' else 'down'} "
                                 f"projections")
            if m["proj"] == "down_proj":
                return [(m["prefix"] + ".w2_weight", (e, None), tensor[e])
                        for e in range(num_experts)]
            half = tensor.shape[1] // 2
            return [(m["prefix"] + ".w13_weight", (e, p), tensor[e, p * half:(p + 1) * half])
                    for e in range(num_experts) for p in (0, 1)]
        return super()._checkpoint_targets(name, tensor)

    def _shard_view(self, param: torch.Tensor, name: str, shard: Any) -> torch.Tensor:
        if isinstance(shard, tuple):  # (expert, 0 gate / 1 up / None down)
            e, part = shard
            block = param.data[e]
            if part is None:
                return block
            size = block.shape[0] // 2
            return block.narrow(0, part * size, size)
        return super()._shard_view(param, name, shard)

    def _rank_part(self, name: str, shard: Any, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(shard, tuple):
            if self.tp is None:
                return tensor
            experts = self.get_submodule(name.rpartition(".")[0])
            i0, n = experts.intermediate_start, experts.intermediate_size
            # gate / up [I, H]: rows; down [H, I]: columns.
            return tensor.narrow(1 if shard[1] is None else 0, i0, n)
        return super()._rank_part(name, shard, tensor)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's attention, every layer's block 8-of-E experts renormalised."""

    num_experts_field = "num_local_experts"
    intermediate_field = "intermediate_size"
    renormalize_field = None
    expert_projections = ("w1", "w3", "w2")

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions()

    @classmethod
    def checkpoint_name(cls, hf_name: str) -> str:
        return hf_name.replace(".block_sparse_moe.", ".mlp.")


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias by ``qkv_bias``), routed
    experts plus a sigmoid-gated shared expert; dense layers where the config says."""

    has_shared_expert = True
    has_dense_layers = True

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    _sliding_window = staticmethod(Qwen2ForCausalLM._sliding_window)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k norms), routed experts; dense layers
    where the config says."""

    has_dense_layers = True

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return Qwen3ForCausalLM.layer_options(config)

    _sliding_window = staticmethod(Qwen3ForCausalLM._sliding_window)


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: q and k each RMSNorm-ed over all heads at once, optional clip_qkv, bias on
    q/k/v/o by ``attention_bias``; every layer's block routed experts."""

    intermediate_field = "intermediate_size"

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        clip = getattr(config, "clip_qkv", None)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not clip > 0):
            raise ValueError(f"config field clip_qkv must be a positive number or null, "
                             f"got {clip!r}")

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        clip = getattr(config, "clip_qkv", None)
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_over_heads=True,
                            clip_qkv=None if clip is None else float(clip))

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        return None  # OLMoE has none
