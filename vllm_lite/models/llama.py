"""Llama-family decoder-only models: Llama 2/3 (rope scaling), Mistral, Qwen2, Qwen3.

Plain PyTorch (gpt-fast / nano-vllm style) over a flat token batch: ``forward(input_ids
[T], positions [T]) -> hidden [T, hidden_size]`` for the tokens of all sequences of a step
concatenated, no padding; the attention layers take the per-step layout from
:mod:`vllm_lite.layers.attention`'s metadata. q/k/v and gate/up are each one fused
``nn.Linear`` (one GEMM instead of three / two); :meth:`LlamaForCausalLM.load_weights`
maps Hugging Face's per-projection checkpoint names onto the fused rows.

The variants differ only in config-driven details (:class:`LayerOptions`): QKV bias
(Qwen2), per-head q/k RMSNorm before rotary (Qwen3), o_proj / MLP bias (Llama's
``attention_bias`` / ``mlp_bias``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import ops
from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.distributed.layers import Shard, VocabParallelEmbedding, all_reduce, gather_vocab
from vllm_lite.layers.attention import Attention, get_attention_metadata
from vllm_lite.layers.layernorm import RMSNorm
from vllm_lite.layers.rotary import RotaryEmbedding, rope_parameters_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each head of q and k (Qwen3)
    # With qk_norm: one RMSNorm over all of q's (k's) heads at once instead (OLMoE).
    qk_norm_over_heads: bool = False
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] (OLMoE's option)


def _head_dim(config: Any) -> int:
    # Mistral / Qwen3 configs carry head_dim explicitly (it may differ from
    # hidden_size / num_heads); older Llama configs don't.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Linear(nn.Linear):
    """``nn.Linear`` that can switch its weight to the CPU GEMM's preferred form for
    inference (:meth:`prepare_for_cpu`); parameters and ``state_dict`` stay nn.Linear's.

    On the CPU, float32 and bfloat16 GEMMs run vllm_lite's own kernels
    (``ops.packed_linear``, csrc/cpu/packed_linear*.cpp) where the selected CPU build has
    them (float32: AVX-512; bfloat16: AVX512_BF16): faster than oneDNN for a decode step's
    projections, whose weights stream from memory, and about even at prefill sizes
    (``benchmarks/linear.py`` measures them); outputs are F.linear's up to float32 accumulation
    order. Elsewhere they go to oneDNN (``mkldnn._linear_pointwise``) with the weight
    prepacked in its blocked layout (AVX2 / AMX, picked by the CPU's features), which for
    float32 is faster than torch's default, MKL's sgemm, at decode sizes. Either packed copy
    doubles these weights' memory, the LM head's included where it is tied to the embedding
    (the parameter stays as it is: the embedding reads it): the packed head is a decode
    step's largest GEMM, so it is worth the memory.

    Other dtypes, devices, autograd, and a torch without oneDNN keep plain ``F.linear``.

    ``gated=True``: the rows are a SwiGLU MLP's [gate | up] (gate_up_proj), which calls
    ``forward(x, silu_and_mul=True)`` for ``ops.silu_and_mul`` of the output. Where the
    own kernels run, the weight is then packed in gated order and that is one GEMM
    (``ops.packed_gated_linear``, the same bits): the unfused activation wrote and read
    back the [tokens, 2I] projection output, which the fused epilogue never materializes.
    """

    _packed: torch.Tensor | None = None  # oneDNN's packed weight
    _own_packed: torch.Tensor | None = None  # ops.pack_linear_weight's
    _bias_f32: torch.Tensor | None = None  # packed_linear's bias
    # oneDNN picks the packed layout for this many rows; 16 served 1..2048 rows well.
    PACK_ROWS_HINT = 16

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None, gated: bool = False
                 ) -> None:
        if gated and out_features % 2:
            raise ValueError(f"a gated Linear needs an even out_features ([gate | up]), "
                             f"got {out_features}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.gated = gated

    def prepare_for_cpu(self) -> None:
        w = self.weight
        self._packed = self._own_packed = self._bias_f32 = None
        if (w.device.type != "cpu" or w.dim() != 2
                or w.dtype not in (torch.float32, torch.bfloat16)):
            return
        with torch.no_grad():
            if (ops.packed_linear_kernel_selected(w.dtype)
                    and (w.dtype == torch.float32 or w.shape[1] % 2 == 0)):
                order = ops.gated_panel_rows if self.gated else (lambda t: t)
                self._own_packed = ops.pack_linear_weight(order(w.detach()))
                if self.bias is not None:
                    self._bias_f32 = order(self.bias.detach().float())
                return
            if not torch.backends.mkldnn.is_available():
                return
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.PACK_ROWS_HINT)
            except (RuntimeError, AttributeError) as e:  # a torch / CPU without the op
                logger.debug("no prepacked %s weight (%s); using F.linear", w.dtype, e)

    @property
    def gated_packed(self) -> bool:
        """Whether the CPU packed weight is in gated order (ops.gated_panel_rows; forward
        with silu_and_mul=True is ``ops.packed_gated_linear`` on it)."""
        return self.gated and self._own_packed is not None

    def decode_form(self, dtype: torch.dtype) -> ops.DecodeForm | None:
        """What forward passes to ``ops.packed_linear`` (``ops.packed_gated_linear`` where
        :attr:`gated_packed`) for a CPU x of ``dtype`` without autograd (see
        :data:`DecodeForm`); None where forward takes another path."""
        if self._own_packed is None or self.weight.dtype != dtype:
            return None
        return self._own_packed, None, None, 0, self._bias_f32

    def forward(self, x: torch.Tensor, silu_and_mul: bool = False) -> torch.Tensor:
        """x @ W.T + b; ``silu_and_mul=True``: ``ops.silu_and_mul`` of it (the rows being
        [gate | up]), [..., out_features / 2], in one GEMM where the layer is packed gated."""
        own, packed = self._own_packed, self._packed
        # A packed copy serves a CPU x of the weight's dtype without autograd (checked
        # only where there is one: the other layers go straight to F.linear).
        if ((own is not None or packed is not None) and x.is_cpu
                and not torch.is_grad_enabled() and x.dtype == self.weight.dtype):
            if own is None:
                y = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            elif not self.gated:
                y = ops.packed_linear(x, own, self._bias_f32, self.out_features)
            elif silu_and_mul:
                return ops.packed_gated_linear(x, own, self._bias_f32, self.out_features // 2)
            else:  # a gated packed copy serves only the fused activation
                y = F.linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return ops.silu_and_mul(y) if silu_and_mul else y


class LlamaAttention(nn.Module):
    """This rank's attention heads (all of them with one rank): q/k/v column-parallel,
    o_proj row-parallel (see vllm_lite.distributed.layers)."""

    def __init__(self, config: Any, opts: LayerOptions, max_position: int,
                 rotary_emb: RotaryEmbedding | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        shard = Shard.of(tp)
        self.tp = tp
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_start, self.num_heads = shard.range(total_heads)
        self.kv_head_start, self.num_kv_heads = shard.kv_heads(total_kv)
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self._qkv_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=opts.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=opts.o_bias)
        self.qk_norm_over_heads = opts.qk_norm and opts.qk_norm_over_heads
        self.clip_qkv = opts.clip_qkv
        if self.qk_norm_over_heads and shard.size > 1:
            # Its statistics span every rank's heads: it would need a reduction of its own.
            raise ValueError("a q/k norm over all heads (OLMoE) is not implemented with "
                             "tensor parallelism; use tensor_parallel_size 1")
        if opts.qk_norm:
            q_dim, k_dim = ((self.q_size, self.kv_size) if self.qk_norm_over_heads
                            else (self.head_dim, self.head_dim))
            self.q_norm: RMSNorm | None = RMSNorm(q_dim, eps=config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(k_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One table shared by all layers (they are identical) unless none is given.
        self.rotary_emb = rotary_emb if rotary_emb is not None else RotaryEmbedding(
            self.head_dim, max_position, rope_parameters_of(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        # split_with_sizes itself: Tensor.split's Python wrapper costs more than the views.
        q, k, v = qkv.split_with_sizes(self._qkv_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            if self.qk_norm_over_heads:  # OLMoE: over all heads at once
                q, k = self.q_norm(q), self.k_norm(k)
            else:  # Qwen3: per-head RMSNorm of q and k, before rotary (as HF)
                q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
                k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        if self.clip_qkv is not None:  # after the norms, before rotary (as HF)
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        # In place, on the fused output's columns (or the normed copies).
        self.rotary_emb(positions, q, k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return all_reduce(self.tp, self.o_proj(self.attn(q, k, v)))


class LlamaMLP(nn.Module):
    """This rank's slice of the intermediate features: gate/up column-parallel, down_proj
    row-parallel."""

    def __init__(self, config: Any, opts: LayerOptions,
                 tp: TensorParallelGroup | None = None, intermediate_size: int | None = None,
                 reduce: bool = True) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.tp = tp
        # intermediate_size: config.intermediate_size unless given (an MoE's shared
        # expert); reduce=False leaves the ranks' partial sums to the caller's all-reduce.
        self.full_intermediate_size = intermediate_size or config.intermediate_size
        self.reduce = reduce
        self.intermediate_start, self.intermediate_size = Shard.of(tp).range(
            self.full_intermediate_size)
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=opts.mlp_bias, gated=True
        )
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=opts.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        # A Linear fuses the activation into its GEMM where it can; a quantized layer
        # (layers/quantization.py) in its place gives [gate | up].
        act = proj(x, silu_and_mul=True) if isinstance(proj, Linear) else ops.silu_and_mul(proj(x))
        out = self.down_proj(act)
        return all_reduce(self.tp, out) if self.reduce else out


class DecodeSettings(NamedTuple):
    """What ``ops.llama_decode_layers`` takes once for all layers: every layer must agree
    (tensors by identity, the rest by value: :func:`_same_settings`)."""

    input_eps: float
    post_attention_eps: float
    intermediate_size: int
    gated_mlp: bool  # gate_up packed gated (Linear.gated_packed)
    cos_sin_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    kv_cache_dtype: str
    k_scale: float
    v_scale: float


@dataclass(frozen=True)
class DecodeParts:
    """What ``ops.llama_decode_layers`` needs of one decoder layer (see
    :meth:`LlamaDecoderLayer.decode_parts`)."""

    norm_weights: tuple[torch.Tensor, torch.Tensor]  # input, post-attention
    projections: tuple[ops.DecodeForm, ...]  # qkv, o, gate_up, down
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    shared: DecodeSettings


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, opts: LayerOptions, max_position: int,
                 rotary_emb: RotaryEmbedding | None = None,
                 tp: TensorParallelGroup | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, opts, max_position, rotary_emb, tp)
        self.mlp = self.make_mlp(config, opts, tp, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: Any, opts: LayerOptions, tp: TensorParallelGroup | None,
                 layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (a subclass's may be a mixture of
        experts, vllm_lite.models.moe)."""
        return LlamaMLP(config, opts, tp)

    def decode_parts(self, dtype: torch.dtype) -> DecodeParts | None:
        """This layer's tensors and settings for ``ops.llama_decode_layers``, which runs what
        forward runs for a decode step on the CPU; None where forward would run anything
        else (tensor parallelism, Qwen3's q/k norms, a projection none of the call's ops
        serves: see each layer's ``decode_form``; no KV cache; a feed-forward block other
        than LlamaMLP or a layer forward other than this class's; a rotary other than
        rotate_half over whole heads)."""
        attn, mlp = self.self_attn, self.mlp
        core = attn.attn
        rotary = attn.rotary_emb
        if (type(self).forward is not LlamaDecoderLayer.forward
                or type(mlp) is not LlamaMLP or attn.tp is not None or mlp.tp is not None
                or attn.q_norm is not None or attn.clip_qkv is not None
                or core.k_cache is None or core.v_cache is None
                or rotary.head_size != core.head_size or rotary.rotary_dim != core.head_size
                or not rotary.is_neox):
            return None
        projections = tuple(
            lin.decode_form(dtype) if hasattr(lin, "decode_form") else None
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        if any(p is None for p in projections):
            return None
        return DecodeParts(
            (self.input_layernorm.weight, self.post_attention_layernorm.weight), projections,
            core.k_cache, core.v_cache,
            DecodeSettings(self.input_layernorm.eps, self.post_attention_layernorm.eps,
                           mlp.intermediate_size,
                           isinstance(mlp.gate_up_proj, Linear) and mlp.gate_up_proj.gated_packed,
                           attn.rotary_emb.cos_sin_cache,
                           core.num_heads, core.num_kv_heads, core.head_size, core.scale,
                           core.kv_cache_dtype, core.k_scale, core.v_scale))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it
        is added). The add of each sublayer's output into the residual stream is fused
        with the next norm (rounded first, as HF's ``hidden = residual + out``); the first
        layer gets residual None and the last add happens in the final norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """``layer_cls`` (default LlamaDecoderLayer) builds each layer; ``rotary_emb`` (default
    rotate_half over whole heads with the config's rope settings) is shared by all."""

    def __init__(self, config: Any, opts: LayerOptions, max_position: int,
                 tp: TensorParallelGroup | None = None,
                 layer_cls: type[LlamaDecoderLayer] | None = None,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = rotary_emb if rotary_emb is not None else RotaryEmbedding(
            _head_dim(config), max_position, rope_parameters_of(config))
        layer_cls = layer_cls or LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(config, opts, max_position, self.rotary_emb, tp, layer_idx=i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Decode steps may run every layer in one native call (_decode_in_one_call); forward
    # hooks on any layer's module (the step profiler's) turn it off by themselves.
    fused_decode = True
    # The call's per-layer arguments, gathered once rather than in Python every step: the
    # key they were gathered for (dtype, each layer's caches), and the lists. Reset by
    # LlamaForCausalLM.prepare_for_cpu, which replaces the packed weights.
    _decode_key: tuple[Any, ...] | None = None
    _decode_args: tuple[Any, ...] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        fused = self._decode_in_one_call(hidden, positions)
        if fused is not None:
            hidden, residual = fused
        else:
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def _decode_in_one_call(self, hidden: torch.Tensor, positions: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last MLP output, residual) of every layer through ``ops.llama_decode_layers``
        for a decode step on the CPU (the same kernels as the layers' forward, one call
        instead of ~20 per layer: README "Throughput"); None where a layer does not
        qualify or the step is not a decode step."""
        if (not self.fused_decode or not len(self.layers) or hidden.device.type != "cpu"
                or hidden.dim() != 2 or torch.is_grad_enabled()
                or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks):
            return None
        meta = get_attention_metadata()
        if meta.is_prompt or hidden.shape[0] != meta.num_seqs:
            return None  # the layers' own path (and its errors)
        key = (hidden.dtype,
               *(t for a in self._attention_cores() for t in (a.k_cache, a.v_cache)))
        last = self._decode_key
        # By identity (dtypes are singletons, tensors count by identity), in C.
        if last is None or len(last) != len(key) or not all(map(operator.is_, key, last)):
            self._decode_args = self._gather_decode_args(hidden.dtype)
            self._decode_key = key
        # Where a layer does not qualify (the usual answer, settled once per key) nothing
        # else is looked at.
        if self._decode_args is None or any(
                m._forward_hooks or m._forward_pre_hooks for m in self._layer_modules()):
            return None
        lists, s = self._decode_args
        residual = torch.empty_like(hidden)
        out = ops.llama_decode_layers(
            hidden, residual, positions, *lists[:6], s.intermediate_size, s.gated_mlp, *lists[6:],
            s.cos_sin_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.block_size, meta.max_seq_len, s.num_heads, s.num_kv_heads, s.head_size,
            s.scale, s.kv_cache_dtype, float(s.k_scale), float(s.v_scale), s.input_eps)
        return out, residual

    def _attention_cores(self) -> tuple[Attention, ...]:
        cores = self.__dict__.get("_cores")
        if cores is None:
            cores = self.__dict__["_cores"] = tuple(l.self_attn.attn for l in self.layers)
        return cores

    def _layer_modules(self) -> tuple[nn.Module, ...]:
        mods = self.__dict__.get("_mods")
        if mods is None:
            mods = self.__dict__["_mods"] = tuple(self.layers.modules())
        return mods

    def _gather_decode_args(self, dtype: torch.dtype) -> tuple[Any, ...] | None:
        """(the op's per-layer lists, the settings every layer shares), or None where a
        layer does not qualify or the layers differ in a setting the op takes once."""
        parts: list[DecodeParts] = []
        for layer in self.layers:
            p = layer.decode_parts(dtype)
            if p is None or (parts and not _same_settings(p.shared, parts[0].shared)):
                return None
            parts.append(p)
        shared = parts[0].shared
        if shared.input_eps != shared.post_attention_eps:  # the op takes one epsilon
            return None
        forms = [f for p in parts for f in p.projections]
        lists = ([w for p in parts for w in p.norm_weights], *map(list, zip(*forms)),
                 [p.k_cache for p in parts], [p.v_cache for p in parts])
        return lists, shared


def _same_settings(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    # Tensors (the rotary table, the caches) by identity, the rest by value.
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


# HF checkpoint name fragment -> (our fused parameter fragment, shard id).
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat token batch.

    ``model(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` under an installed
    :class:`~vllm_lite.layers.attention.AttentionMetadata`; ``compute_logits(hidden)``
    -> float32 [T, vocab]. ``max_model_len`` (default ``max_position_embeddings``)
    bounds the positions and the rotary table. ``tp``: this rank's tensor-parallel group
    (None: the whole model); every rank builds its shards and loads its slices of the
    checkpoint's tensors, and ``compute_logits`` gathers the vocabulary (all ranks call it).
    """

    # Each decoder layer's class (a subclass of LlamaDecoderLayer).
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: Any, max_model_len: int | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        max_position = max_model_len or config.max_position_embeddings
        self.sliding_window = self._sliding_window(config)
        if self.sliding_window is not None and self.sliding_window < max_position:
            # Neither the prefill path nor the paged-attention kernel windows attention,
            # so contexts longer than the window would diverge from the reference model.
            logger.warning(
                "%s: sliding_window=%d is not implemented; outputs are exact only for "
                "contexts up to %d tokens (cap max_model_len there)",
                type(self).__name__, self.sliding_window, self.sliding_window,
            )
        self.model = LlamaModel(config, self.layer_options(config), max_position, tp,
                                self.decoder_layer_cls, self.rotary_embedding(config, max_position))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # The head holds the embedding's vocabulary rows (its own copy unless tied).
        self.lm_head = Linear(config.hidden_size, self.model.embed_tokens.num_embeddings,
                              bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def check_config(cls, config: Any) -> None:
        """ValueError naming the config field for a setting this class cannot run; called
        first, before anything is allocated or any weight read. The Llama family has
        nothing to check beyond read_hf_config's sizes (its MoE and GLM subclasses do)."""

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    @classmethod
    def rotary_embedding(cls, config: Any, max_position: int) -> RotaryEmbedding:
        """The rotary table every layer shares: rotate_half over whole heads."""
        return RotaryEmbedding(_head_dim(config), max_position, rope_parameters_of(config))

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        return getattr(config, "sliding_window", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype: the sampler takes float32 copies where its
        softmax needs them, and its plain greedy path reads bf16 logits as they are (no
        float32 copy of [rows, vocab] per decode step)."""
        logits = self.lm_head(hidden)
        if self.tp is None:  # the whole vocabulary already (and no config lookup a step)
            return logits
        return gather_vocab(self.tp, logits, self.config.vocab_size)

    def attention_layers(self) -> list[Attention]:
        """The Attention layers in order; the runner assigns each its k_cache/v_cache."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused) parameters.

        Raises ValueError on an unknown name, a shape mismatch, or, at the end, any
        parameter (or fused shard) that no tensor filled.
        """
        params = dict(self.named_parameters())
        expected: set[tuple[str, Any]] = set()
        for name in params:
            expected.update((name, s) for s in self._shards_of(name))
        loaded: set[tuple[str, Any]] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or "rotary_emb.cos_cached" in hf_name \
                    or "rotary_emb.sin_cached" in hf_name:
                continue  # old checkpoints saved the rotary buffers; we recompute them
            if self.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # tied: the embedding is the head (some checkpoints store both)
            for name, shard, part in self._checkpoint_targets(hf_name, tensor):
                param = params.get(name)
                if param is None:
                    unexpected.append(hf_name)
                    break
                target = self._shard_view(param, name, shard)
                part = self._rank_part(name, shard, part)
                if target.shape != part.shape:
                    raise ValueError(
                        f"weight {hf_name}: checkpoint shape {tuple(part.shape)} does not "
                        f"match the model's {tuple(target.shape)} (config mismatch?)"
                    )
                with torch.no_grad():
                    target.copy_(part)
                loaded.add((name, shard))
        if unexpected:
            raise ValueError(
                f"unexpected weights in the checkpoint for {type(self).__name__}: "
                f"{sorted(unexpected)[:20]}{' ...' if len(unexpected) > 20 else ''}"
            )
        missing = expected - loaded
        if missing:
            names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
            raise ValueError(
                f"weights missing from the checkpoint for {type(self).__name__}: "
                f"{names[:20]}{' ...' if len(names) > 20 else ''}"
            )
        self.prepare_for_cpu()

    def _shards_of(self, name: str) -> tuple[Any, ...]:
        """The shards of parameter ``name`` that checkpoint tensors fill, each once (None:
        the whole parameter)."""
        if ".qkv_proj." in name:
            return ("q", "k", "v")
        if ".gate_up_proj." in name:
            return (0, 1)
        return (None,)

    def _checkpoint_targets(self, hf_name: str, tensor: torch.Tensor
                            ) -> list[tuple[str, Any, torch.Tensor]]:
        """(our parameter name, its shard, the tensor for it) for a checkpoint tensor: HF's
        separate q/k/v and gate/up projections fill rows of the fused ones."""
        for hf_part, our_part, shard_id in _STACKED:
            if hf_part in hf_name:
                return [(hf_name.replace(hf_part, our_part), shard_id, tensor)]
        return [(hf_name, None, tensor)]

    def prepare_for_cpu(self) -> None:
        """Puts every projection and the head in the CPU GEMM's preferred weight form
        (see :class:`Linear`); run by :meth:`load_weights`, again after changing weights.
        Nothing changes on other devices."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare_for_cpu()
        self.model._decode_key = self.model._decode_args = None  # new packed weights

    def relocate_packed_weights(self, copy: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                                ) -> int:
        """Replaces the projections' packed CPU weights (:meth:`prepare_for_cpu`'s, and the
        ``qweight`` buffers of the CPU quantized layers, layers/quantization.py) by
        ``copy(their list)``, the same values elsewhere in memory: the CPU worker moves them
        into huge pages (worker/cpu_malloc.copy_to_huge_pages). Returns how many moved."""
        slots = []
        for m in self.modules():
            if isinstance(m, Linear) and m._own_packed is not None:
                slots.append((m, "_own_packed"))
            elif (getattr(m, "on_cpu", False) and isinstance(getattr(m, "qweight", None), torch.Tensor)
                  and m.qweight.is_contiguous()):
                slots.append((m, "qweight"))
        moved = copy([getattr(m, name) for m, name in slots])
        for (module, name), tensor in zip(slots, moved, strict=True):
            setattr(module, name, tensor)
        self.model._decode_key = self.model._decode_args = None
        return len(slots)

    def _rank_part(self, name: str, shard: str | int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (all of it with one rank): its vocabulary
        rows (zero-padded) of the embedding and head, else what :meth:`tp_segments` gives
        its fused projection (rows of q/k/v and gate/up, columns of o_proj and down_proj);
        row-parallel biases on rank 0 only (added once, before the all-reduce sums ranks)."""
        if self.tp is None:
            return tensor
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            embed = self.model.embed_tokens
            rows = tensor.new_zeros(embed.num_embeddings, *tensor.shape[1:])
            part = tensor[embed.vocab_start:embed.vocab_start + embed.num_embeddings]
            rows[:part.shape[0]] = part
            return rows
        module, _, kind = name.rpartition(".")
        seg = self.tp_segments(module)
        if seg is None:
            return tensor
        dim, segments = seg
        if dim == 1:
            if kind == "bias":
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            (start, size), = segments
            return tensor.narrow(1, start, size)
        # One HF part of a fused column-parallel projection: its segment, less where the
        # part starts in the unsplit fused weight.
        cfg = self.config
        if isinstance(shard, str):
            d = self.model.layers[0].self_attn.head_dim
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            index, part_starts = "qkv".index(shard), (0, heads * d, (heads + kv_heads) * d)
        else:
            mlp = self.get_submodule(module.rpartition(".")[0])
            index, part_starts = shard, (0, mlp.full_intermediate_size)
        start, size = segments[index]
        return tensor.narrow(0, start - part_starts[index], size)

    def tp_segments(self, module: str) -> tuple[int, list[tuple[int, int]]] | None:
        """This rank's part of the unsplit fused projection ``module`` (e.g.
        ``model.layers.3.self_attn.qkv_proj``): (dim, [(start, size), ...]) in the unsplit
        weight's coordinates, rows (dim 0) of q/k/v and gate/up, columns (dim 1) of o_proj
        and down_proj; None with one rank or for an unsplit module."""
        if self.tp is None:
            return None
        attn = self.model.layers[0].self_attn
        d = attn.head_dim
        q_all = attn.num_heads * self.tp.size * d
        kv_all = (getattr(self.config, "num_key_value_heads", None)
                  or self.config.num_attention_heads) * d
        if module.endswith((".gate_up_proj", ".down_proj")):
            # Its MLP's slice (an MoE model's dense and shared-expert MLPs differ in size).
            mlp = self.get_submodule(module.rpartition(".")[0])
            inter = mlp.full_intermediate_size
            i0, n = mlp.intermediate_start, mlp.intermediate_size
        if module.endswith(".qkv_proj"):
            kv0, nkv = attn.kv_head_start * d, attn.num_kv_heads * d
            return 0, [(attn.head_start * d, attn.num_heads * d), (q_all + kv0, nkv),
                       (q_all + kv_all + kv0, nkv)]
        if module.endswith(".gate_up_proj"):
            return 0, [(i0, n), (inter + i0, n)]
        if module.endswith(".o_proj"):
            return 1, [(attn.head_start * d, attn.num_heads * d)]
        if module.endswith(".down_proj"):
            return 1, [(i0, n)]
        return None

    def _shard_view(self, param: torch.Tensor, name: str, shard: str | int | None) -> torch.Tensor:
        """The rows of a fused parameter that one HF projection fills (a view)."""
        if shard is None:
            return param.data
        if isinstance(shard, str):  # q / k / v of qkv_proj (weight rows or bias entries)
            attn = self.model.layers[0].self_attn
            q, kv = attn.q_size, attn.kv_size
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:  # gate (0) / up (1) of gate_up_proj: its MLP's intermediate size
            size = self.get_submodule(name.rsplit(".", 2)[0]).intermediate_size
            start = shard * size
        return param.data.narrow(0, start, size)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers; differs only in its (unimplemented) sliding window."""

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: bias on q/k/v (not on o_proj)."""

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=True)

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        # Qwen2 windows only when use_sliding_window is set (off in released models).
        return config.sliding_window if getattr(config, "use_sliding_window", False) else None


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before rotary; attention_bias on all four."""

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        return config.sliding_window if getattr(config, "use_sliding_window", False) else None
