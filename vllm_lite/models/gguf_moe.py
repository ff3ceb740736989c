"""GGUF files the engine converts itself into HF names: mixtures of experts, and dense
Llama files whose every tensor and setting this mapping carries (the default model).

transformers' GGUF loading, which the other dense files go through
(:mod:`vllm_lite.models.gguf`), reads a file's header three times (config, weights,
tokenizer: most of a conversion's time for the default model, where this module gives the
same weights bit for bit and the same config), and it knows no Mixtral (llama.cpp writes
it as architecture ``llama`` with an ``expert_count``) and no OLMoE, and builds Qwen2-MoE /
Qwen3-MoE without their expert sizes (``expert_feed_forward_length``,
``expert_shared_feed_forward_length``).
So for these files this module maps llama.cpp's tensors and metadata to the HF checkpoint
layout itself (the header was checked first: :func:`~vllm_lite.models.gguf_file.check_model`):

==============================  ==========================================================
GGUF (blk.N.)                   HF (model.layers.N.)
==============================  ==========================================================
ffn_gate_inp                    mlp.gate (Mixtral: block_sparse_moe.gate)
ffn_gate_exps / ffn_up_exps     mlp.experts.E.gate_proj / up_proj (Mixtral: w1 / w3), the
                                stacked [experts, I, H] tensor cut per expert
ffn_down_exps                   mlp.experts.E.down_proj (Mixtral: w2), [experts, H, I]
ffn_{gate,up,down}_shexp        mlp.shared_expert.{gate,up,down}_proj (Qwen2-MoE)
ffn_gate_inp_shexp              mlp.shared_expert_gate, [1, H] (Qwen2-MoE)
attn_q_norm / attn_k_norm       self_attn.q_norm / k_norm (Qwen3-MoE, OLMoE)
==============================  ==========================================================

plus the dense names every architecture shares (attention, norms, embeddings, head).
llama.cpp permutes a llama file's attn_q / attn_k rows for its rotary layout; they are
permuted back (the Qwen MoEs and OLMoE are written unpermuted). The routing settings the
file leaves out are llama.cpp's for the architecture (softmax gating, top-k weights
renormalised for Mixtral and Qwen3-MoE, not for Qwen2-MoE and OLMoE unless
``expert_weights_norm`` says). Quantized tensors (any type the ``gguf`` package
dequantizes) are dequantized to float32 here, the float model's weights; with
quantization="gguf" (the default on a CPU where every projection is Q4_0 / Q4_1 / Q8_0)
the projections, each expert's included, are then swapped for the file's own blocks
(vllm_lite.models.gguf_quant.read_llama_projections).
A tensor the mapping has no place for is refused, never dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_lite.models.gguf_file import GGUFHeader, GGUFModelSizes, tensor_data

logger = logging.getLogger(__name__)

#: GGUF architecture -> (HF architecture, transformers config class name).
_HF = {"llama": ("MixtralForCausalLM", "MixtralConfig"),
       "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
       "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
       "olmoe": ("OlmoeForCausalLM", "OlmoeConfig")}
#: Dense GGUF architectures converted here (see converts_dense): -> (HF architecture, class).
_HF_DENSE = {"llama": ("LlamaForCausalLM", "LlamaConfig")}
#: A dense Llama layer's tensors (a file with any other is left to transformers).
_DENSE_LLAMA_LAYER = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight",
                      "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                      "ffn_down.weight")
#: Per-layer tensors of every architecture: GGUF suffix -> HF suffix.
_COMMON = {"attn_norm.weight": "input_layernorm.weight",
           "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
           "attn_v.weight": "self_attn.v_proj.weight",
           "attn_output.weight": "self_attn.o_proj.weight",
           "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.bias": "self_attn.v_proj.bias",
           "attn_q_norm.weight": "self_attn.q_norm.weight",
           "attn_k_norm.weight": "self_attn.k_norm.weight",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight",
           "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
           "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
           "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
#: The stacked experts: GGUF suffix -> index of (gate, up, down).
_EXPERTS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
#: rope.scaling.type values mapped onto HF's rope_parameters.
_ROPE_SCALING = ("none", "linear")


def _meta(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.metadata.get(f"{header.metadata['general.architecture']}.{key}", default)


def _token_id(header: GGUFHeader, key: str) -> int | None:
    value = header.metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def converts_dense(header: GGUFHeader) -> bool:
    """Whether this module converts the (checked, dense) file: a Llama without rope
    scaling whose tensors all have a place in the HF checkpoint (a llama3 file's rope_freqs,
    say, has none: transformers converts such files)."""
    arch = header.metadata.get("general.architecture")
    if arch not in _HF_DENSE or _meta(header, "rope.scaling.type", "none") != "none":
        return False
    for name in header.tensors:
        parts = name.split(".", 2)
        if name not in _GLOBAL and (len(parts) != 3 or parts[0] != "blk"
                                    or parts[2] not in _DENSE_LLAMA_LAYER):
            return False
    return True


def hf_config(header: GGUFHeader, sizes: GGUFModelSizes) -> dict[str, Any]:
    """config.json of the HF model the (checked) MoE file, or dense file converts_dense
    takes, holds, built by transformers' config class of the architecture (its defaults for
    what the file cannot state, e.g. the initializer range, which nothing here uses).
    ValueError naming the key for a setting the conversion cannot carry (rope scaling
    other than linear, a missing norm epsilon or context length)."""
    import transformers

    arch = sizes.architecture
    dense = sizes.num_experts is None
    hf_arch, config_cls = (_HF_DENSE if dense else _HF)[arch]
    where = f"GGUF file {header.path}"
    eps = _meta(header, "attention.layer_norm_rms_epsilon")
    if eps is None:
        raise ValueError(f"{where}: metadata {arch}.attention.layer_norm_rms_epsilon is missing")
    if sizes.max_position_embeddings is None:
        raise ValueError(f"{where}: metadata {arch}.context_length is missing")
    # llama.cpp's default rope base when the file states none.
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(_meta(header, "rope.freq_base", 10000.0))}
    scaling = _meta(header, "rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING:
        raise ValueError(f"{where}: metadata {arch}.rope.scaling.type {scaling!r} is not "
                         f"supported for a mixture-of-experts GGUF ({', '.join(_ROPE_SCALING)})")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear",
                "factor": float(_meta(header, "rope.scaling.factor", 1.0))}
    kw: dict[str, Any] = dict(
        vocab_size=sizes.vocab_size, hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size, num_hidden_layers=sizes.num_hidden_layers,
        num_attention_heads=sizes.num_attention_heads,
        num_key_value_heads=sizes.num_key_value_heads,
        max_position_embeddings=sizes.max_position_embeddings, rms_norm_eps=float(eps),
        rope_parameters=rope, tie_word_embeddings=sizes.tie_word_embeddings, hidden_act="silu",
        bos_token_id=_token_id(header, "bos_token_id"),
        eos_token_id=_token_id(header, "eos_token_id"),
        pad_token_id=_token_id(header, "padding_token_id"),
        **({} if dense else {"num_experts_per_tok": sizes.num_experts_per_tok}))
    if dense:  # as transformers' GGUF loading writes a Llama's config
        kw.update(head_dim=sizes.head_dim, attention_bias=False, mlp_bias=False,
                  unk_token_id=_token_id(header, "unknown_token_id"))
        if header.metadata.get("general.name") is not None:
            kw.update(_model_name_or_path=header.metadata["general.name"])
    elif arch == "llama":
        kw.update(num_local_experts=sizes.num_experts, head_dim=sizes.head_dim,
                  intermediate_size=sizes.moe_intermediate_size, sliding_window=None)
    elif arch == "olmoe":
        clip = _meta(header, "attention.clamp_kqv")
        kw.update(num_experts=sizes.num_experts, intermediate_size=sizes.moe_intermediate_size,
                  norm_topk_prob=sizes.norm_topk_prob, attention_bias=False,
                  clip_qkv=None if clip is None else float(clip))
    else:
        kw.update(num_experts=sizes.num_experts, moe_intermediate_size=sizes.moe_intermediate_size,
                  norm_topk_prob=sizes.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=list(sizes.mlp_only_layers))
        if arch == "qwen2moe":
            kw.update(shared_expert_intermediate_size=sizes.shared_expert_intermediate_size,
                      qkv_bias="blk.0.attn_q.bias" in header.tensors)
        else:
            kw.update(head_dim=sizes.head_dim, attention_bias=False)
    config = getattr(transformers, config_cls)(**kw).to_dict()
    for key in ("torch_dtype", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=[hf_arch], dtype="float32")
    return config


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's rotary row permutation of a llama attn_q / attn_k (rows of each
    head: [half 0 interleaved with half 1] -> [half 0, half 1]); works on biases too."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def hf_weights(header: GGUFHeader, sizes: GGUFModelSizes
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the (checked) file the header was read
    from, dequantized; a tensor with no HF place (or a type the gguf package cannot
    dequantize) is a ValueError naming it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arch = sizes.architecture
    moe_block = "block_sparse_moe" if arch == "llama" else "mlp"
    names = ("w1", "w3", "w2") if arch == "llama" else ("gate_proj", "up_proj", "down_proj")
    kinds: dict[str, int] = {}
    gguf_file = header.path
    data = tensor_data(header)
    for t in header.tensors.values():
        kind = t.type_name
        try:
            # A copy: the file's F32 tensors come as read-only views of its mapping.
            w = torch.from_numpy(np.array(dequantize(data[t.name], GGMLQuantizationType[kind]),
                                          dtype=np.float32))
        except NotImplementedError:
            raise ValueError(f"GGUF file {gguf_file}: tensor {t.name} is {kind}, which the gguf "
                             "package cannot dequantize") from None
        w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml order -> torch order
        kinds[kind] = kinds.get(kind, 0) + 1
        if t.name in _GLOBAL:
            yield _GLOBAL[t.name], w
            continue
        _, layer, part = t.name.split(".", 2) if t.name.startswith("blk.") else ("", "", t.name)
        pre = f"model.layers.{layer}."
        if part in _EXPERTS:
            proj = names[_EXPERTS[part]]
            for e in range(w.shape[0]):
                yield f"{pre}{moe_block}.experts.{e}.{proj}.weight", w[e].clone()
        elif part == "ffn_gate_inp.weight":
            yield f"{pre}{moe_block}.gate.weight", w
        elif part == "ffn_gate_inp_shexp.weight" and arch == "qwen2moe":
            yield f"{pre}mlp.shared_expert_gate.weight", w.reshape(1, -1)
        elif layer and part in _COMMON:
            if arch == "llama" and part.startswith(("attn_q.", "attn_k.")):
                w = _unpermute(w, sizes.num_attention_heads if part.startswith("attn_q.")
                               else sizes.num_key_value_heads)
            yield pre + _COMMON[part], w
        else:
            raise ValueError(f"GGUF file {gguf_file}: tensor {t.name} has no place in a "
                             f"{_HF[arch][0]} (not converted)")
    logger.info("dequantized the GGUF tensors to float32 (%s)",
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))


def read_tokenizer(gguf_file: Path) -> Any:
    """The file's tokenizer, through transformers' GGUF tokenizer conversion (which takes
    only the tokenizer.* metadata, whatever the architecture)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                   local_files_only=True)
