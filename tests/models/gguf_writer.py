"""Writes a tiny HF mixture-of-experts model as llama.cpp's converter would (its tensor
names and metadata keys, from the gguf package's constants and GGUFWriter): what the MoE
GGUF tests load. The HF model's weights are set to what the file holds (each tensor
quantized and dequantized again), so it is the reference for the loaded file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: HF model_type -> GGUF architecture.
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "olmoe": "olmoe"}


def _tokenizer_fields(folder: Path) -> dict[str, Any]:
    """The byte-level BPE of tests/models/helpers.make_tokenizer as GGUF tokenizer data."""
    from .helpers import make_tokenizer

    tok = json.loads(make_tokenizer(folder).backend_tokenizer.to_str())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {"tokens": tokens, "merges": merges, "eos": vocab["<eos>"]}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row permutation of a llama q / k projection."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_moe_gguf(hf_model: Any, path: Path, qtype: str = "F32",
                   extra: dict[str, Any] | None = None) -> Path:
    """``hf_model`` (a MixtralForCausalLM, Qwen2Moe..., Qwen3Moe..., OlmoeForCausalLM; its
    vocab no larger than the test tokenizer's) as a GGUF file: the projections and experts
    stored as ``qtype`` (F32, F16, Q8_0, Q4_1, ...), norms and routers as F32 (as llama.cpp
    keeps 1-D tensors and small routers). ``extra``: more metadata (key -> value)."""
    import gguf
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    arch = GGUF_ARCH[cfg.model_type]
    assert arch in MODEL_ARCH_NAMES.values()
    kind = gguf.GGMLQuantizationType[qtype]
    tok = _tokenizer_fields(path.parent / f"{path.stem}_tokenizer")
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(f"tiny {cfg.model_type}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_expert_count(cfg.num_experts)
        writer.add_feed_forward_length(cfg.intermediate_size)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "olmoe" and cfg.clip_qkv is not None:
        writer.add_clamp_kqv(cfg.clip_qkv)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types([3 if t == "<eos>" else 1 for t in tok["tokens"]])
    writer.add_token_merges(tok["merges"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_bos_token_id(tok["eos"])

    state = hf_model.state_dict()
    names = {t: TENSOR_NAMES[t] for t in MODEL_TENSOR}

    def add(name: str, hf_name: str, w: torch.Tensor | None = None, store: Any = None,
            permute_heads: int | None = None) -> None:
        """Writes ``w`` (default: the HF tensor) as ``name`` and sets the HF weight to
        what the file then holds."""
        t = np.ascontiguousarray((state[hf_name] if w is None else w).detach().float().numpy())
        k = store or (kind if t.ndim >= 2 and t.shape[-1] % 32 == 0 else
                      gguf.GGMLQuantizationType.F32)
        if permute_heads:
            t = _permute(t, permute_heads)
        if k in (gguf.GGMLQuantizationType.F32,):
            data, back = t, t
        elif k == gguf.GGMLQuantizationType.F16:
            data = t.astype(np.float16)
            back = data.astype(np.float32)
        else:
            data = quantize(t, k)
            back = dequantize(data, k).reshape(t.shape)
        writer.add_tensor(name, data, raw_dtype=k if k not in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None)
        if permute_heads:  # the HF weight is the unpermuted one
            back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2,
                                *back.shape[1:]).swapaxes(1, 2).reshape(back.shape)
        if w is None:
            with torch.no_grad():
                state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(back)))
        else:
            w.copy_(torch.from_numpy(np.ascontiguousarray(back)).reshape(w.shape))

    f32 = gguf.GGMLQuantizationType.F32
    add(names[MODEL_TENSOR.TOKEN_EMBD] + ".weight", "model.embed_tokens.weight")
    add(names[MODEL_TENSOR.OUTPUT_NORM] + ".weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        add(names[MODEL_TENSOR.OUTPUT] + ".weight", "lm_head.weight")
    attn = {MODEL_TENSOR.ATTN_NORM: "input_layernorm", MODEL_TENSOR.FFN_NORM:
            "post_attention_layernorm", MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
            MODEL_TENSOR.ATTN_K: "self_attn.k_proj", MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
            MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj", MODEL_TENSOR.ATTN_Q_NORM:
            "self_attn.q_norm", MODEL_TENSOR.ATTN_K_NORM: "self_attn.k_norm"}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for t, hf in attn.items():
            for suffix in ("weight", "bias"):
                hf_name = f"{pre}{hf}.{suffix}"
                if hf_name not in state:
                    continue
                heads = None
                if arch == "llama" and t in (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K):
                    heads = cfg.num_attention_heads if t == MODEL_TENSOR.ATTN_Q \
                        else cfg.num_key_value_heads
                add(names[t].format(bid=i) + f".{suffix}", hf_name, permute_heads=heads)
        if pre + "mlp.experts.gate_up_proj" not in state:  # a dense layer
            for t, hf in ((MODEL_TENSOR.FFN_GATE, "gate_proj"), (MODEL_TENSOR.FFN_UP, "up_proj"),
                          (MODEL_TENSOR.FFN_DOWN, "down_proj")):
                add(names[t].format(bid=i) + ".weight", f"{pre}mlp.{hf}.weight")
            continue
        add(names[MODEL_TENSOR.FFN_GATE_INP].format(bid=i) + ".weight", pre + "mlp.gate.weight",
            store=f32)
        gate_up = state[pre + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
        inter = gate_up.shape[1] // 2
        add(names[MODEL_TENSOR.FFN_GATE_EXP].format(bid=i) + ".weight", "",
            w=gate_up.data[:, :inter])
        add(names[MODEL_TENSOR.FFN_UP_EXP].format(bid=i) + ".weight", "",
            w=gate_up.data[:, inter:])
        add(names[MODEL_TENSOR.FFN_DOWN_EXP].format(bid=i) + ".weight",
            pre + "mlp.experts.down_proj")
        if arch == "qwen2moe":
            add(names[MODEL_TENSOR.FFN_GATE_INP_SHEXP].format(bid=i) + ".weight", "",
                w=state[pre + "mlp.shared_expert_gate.weight"].data.view(-1), store=f32)
            for t, hf in ((MODEL_TENSOR.FFN_GATE_SHEXP, "gate_proj"),
                          (MODEL_TENSOR.FFN_UP_SHEXP, "up_proj"),
                          (MODEL_TENSOR.FFN_DOWN_SHEXP, "down_proj")):
                add(names[t].format(bid=i) + ".weight", f"{pre}mlp.shared_expert.{hf}.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
