"""The quantized projections of a GGUF Llama or mixture-of-experts file, kept quantized
(``quantization="gguf"``; a MoE file's experts too, cut from its stacked expert tensors).

The converted cache folder (:mod:`vllm_lite.models.gguf`) holds dequantized float32
weights; this module reads the GGUF file's own blocks instead and turns each projection's
Q4_0 / Q4_1 blocks into the int4 form of :class:`~vllm_lite.layers.quantization.Int4Linear`
with no rounding at all:

- Q4_1, 20-byte blocks of 32 weights: fp16 d, fp16 m, 16 bytes of nibbles (byte j: weight
  j in the low nibble, weight j + 16 in the high one); w = d * q + m -> scale d, zero m.
- Q4_0, 18-byte blocks: fp16 d, 16 bytes of nibbles; w = d * (q - 8) -> scale d, zero -8 d.
- Q8_0, 34-byte blocks: fp16 d, 32 int8 q; w = d * q. vllm_lite's int8 op has one scale per
  row, so these keep their per-32 scales in :class:`Int8GroupWeight` (Int8GroupLinear); a
  fused projection mixing Q8_0 and Q4_0 parts turns the Q4_0 ones into that form too (q - 8
  fits int8, exactly), Q4_1 with Q8_0 is refused.

llama.cpp's converter permutes the rows of attn_q / attn_k (its rotary layout); they are
permuted back as transformers does for the dequantized weights, which moves whole rows, so
blocks stay intact (the Qwen MoEs and OLMoE are written unpermuted). Our fused projections
(qkv_proj = q | k | v rows, gate_up_proj = gate | up, per expert too) are the row
concatenations. Other types (Q4_K, Q6_K, ...) are refused with an error
naming the tensor and type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_lite.models.gguf_file import read_header, tensor_data

#: Weights per block of the kept types; the int4 group size they give.
GGUF_GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class Int4Weight:
    """One projection in Int4Linear's form: w[n, k] = q * scales[n, k // g] + zeros[...].

    ``perm`` (GPTQ act-order): the stored columns are the input's in the order ``perm``
    (stored column j is input column perm[j]), so that each group is contiguous; the layer
    gathers x's columns with it. None: the input's own order."""

    qweight: torch.Tensor  # uint8 [N, K / 2]: k = 2j low nibble, 2j + 1 high nibble
    scales: torch.Tensor   # float32 [N, K / g]
    zeros: torch.Tensor    # float32 [N, K / g]
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], columns in the input's order."""
        q = unpack_nibbles(self.qweight).float()
        g = self.group_size
        n, k = q.shape
        w = (q.view(n, k // g, g) * self.scales[..., None] + self.zeros[..., None]).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.qweight[index].contiguous(), self.scales[index].contiguous(),
                          self.zeros[index].contiguous(), self.group_size, self.perm)


@dataclass
class Int8GroupWeight:
    """One projection in Int8GroupLinear's form (GGUF Q8_0): w[n, k] = q[n, k] *
    scales[n, k // group_size]."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor   # float32 [N, K / g]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        n, k = self.qweight.shape
        g = self.group_size
        return (self.qweight.float().view(n, k // g, g) * self.scales[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> Int8GroupWeight:
        return Int8GroupWeight(self.qweight[index].contiguous(), self.scales[index].contiguous(),
                               self.group_size)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 -> [N, K / 2], k = 2j in the low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: uint8 [N, K]."""
    n, half = packed.shape
    out = torch.empty(n, 2 * half, dtype=torch.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def _decode(kind: str, raw: np.ndarray, rows: int, cols: int) -> Int4Weight | Int8GroupWeight:
    """raw uint8 [rows, cols / 32 * block bytes] of Q4_0 / Q4_1 / Q8_0 blocks -> the
    weight, exactly."""
    nb = cols // GGUF_GROUP
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q8 = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, cols)
        return Int8GroupWeight(torch.from_numpy(q8.copy()),
                               torch.from_numpy(np.ascontiguousarray(d)), GGUF_GROUP)
    if kind == "Q4_1":
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:20]
    else:
        zero = -8.0 * d
        qs = blocks[..., 2:18]
    q = np.empty((rows, nb, GGUF_GROUP), dtype=np.uint8)
    q[..., :16] = qs & 0xF
    q[..., 16:] = qs >> 4
    return Int4Weight(pack_nibbles(torch.from_numpy(q.reshape(rows, cols))),
                      torch.from_numpy(np.ascontiguousarray(d)),
                      torch.from_numpy(np.ascontiguousarray(zero)), GGUF_GROUP)


def _unpermute_rows(w: Int4Weight | Int8GroupWeight, n_head: int) -> Int4Weight | Int8GroupWeight:
    """Undoes llama.cpp's Q/K row permutation (rows of each head: [half 0 interleaved with
    half 1] -> [half 0, half 1]), as transformers' GGUF loader does for float weights."""
    rows = w.qweight.shape[0]
    dim = rows // n_head // 2
    index = torch.arange(rows).view(n_head, dim, 2).transpose(1, 2).reshape(rows)
    return w.rows(index)


def _as_int8_groups(w: Int4Weight | Int8GroupWeight, name: str) -> Int8GroupWeight:
    """A Q4_0 weight (zero = -8 scale) as int8 groups: q - 8 in -8..7, same scale, exact."""
    if isinstance(w, Int8GroupWeight):
        return w
    if not torch.equal(w.zeros, -8.0 * w.scales):
        raise ValueError(f"quantization='gguf': {name} fuses Q8_0 with Q4_1 parts, which have "
                         f"no common exact form")
    q = unpack_nibbles(w.qweight).to(torch.int16).sub_(8).to(torch.int8)
    return Int8GroupWeight(q, w.scales, w.group_size)


def cat_rows(parts: list[Int4Weight], name: str) -> Int4Weight:
    """The fused projection (parts' rows stacked, e.g. q | k | v). Parts must share the
    group size and the column order (perm): the fused layer has one of each."""
    first = parts[0]
    for p in parts[1:]:
        if p.group_size != first.group_size or (
                (p.perm is None) != (first.perm is None)
                or (p.perm is not None and not torch.equal(p.perm, first.perm))):
            raise ValueError(f"{name}: its parts differ in group size or act-order (g_idx), so "
                             f"they cannot be fused into one layer")
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.zeros for p in parts]), first.group_size, first.perm)


def _cat(parts: list[Int4Weight | Int8GroupWeight], name: str) -> Int4Weight | Int8GroupWeight:
    if all(isinstance(p, Int4Weight) for p in parts):
        return cat_rows(parts, name)  # type: ignore[arg-type]
    q8 = [_as_int8_groups(p, name) for p in parts]
    return Int8GroupWeight(torch.cat([p.qweight for p in q8]), torch.cat([p.scales for p in q8]),
                           GGUF_GROUP)


#: The decoder projections' GGUF tensors, grouped as our fused layers take them (a dense
#: layer's; :func:`_layer_parts` gives a mixture-of-experts layer's).
_FUSED_PARTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
                ("ffn_down",))
#: Our module (under model.layers.N.) of each group of :func:`_layer_parts`.
_OURS = {"attn_q": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
         "ffn_gate_exps": "mlp.experts.{e}.gate_up_proj",
         "ffn_down_exps": "mlp.experts.{e}.down_proj",
         "ffn_gate_shexp": "mlp.shared_expert.gate_up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj"}
#: HF architectures whose GGUF attn_q / attn_k rows llama.cpp writes unpermuted.
_UNPERMUTED = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")


def _layer_parts(names: Any, i: int) -> tuple[tuple[str, ...], ...]:
    """The fused groups of layer ``i``'s projections, given the file's tensor names: a
    mixture-of-experts layer (stacked ``ffn_*_exps``, [experts, N, K] blocks, cut per
    expert; Qwen2-MoE's ``ffn_*_shexp`` shared expert) or a dense one."""
    if f"blk.{i}.ffn_gate_exps.weight" not in names:
        return _FUSED_PARTS
    parts = _FUSED_PARTS[:2] + (("ffn_gate_exps", "ffn_up_exps"), ("ffn_down_exps",))
    if f"blk.{i}.ffn_gate_shexp.weight" in names:
        parts += (("ffn_gate_shexp", "ffn_up_shexp"), ("ffn_down_shexp",))
    return parts


def why_not_kept(gguf_file: str | Path, num_layers: int) -> str | None:
    """None when quantization="gguf" can keep every decoder projection of the file (each
    Q4_0 / Q4_1 / Q8_0, no fused layer mixing Q8_0 with Q4_1), a mixture of experts'
    experts included; else why not, in words. Reads the tensor table only (what the
    engine's default for a GGUF model is decided on)."""
    types = {name: t.type_name for name, t in read_header(gguf_file).tensors.items()}
    for i in range(num_layers):
        for parts in _layer_parts(types, i):
            kinds = [types.get(f"blk.{i}.{p}.weight") for p in parts]
            for part, kind in zip(parts, kinds):
                if kind not in _BLOCK_BYTES:
                    return f"blk.{i}.{part}.weight is {kind or 'missing'}"
            if "Q8_0" in kinds and "Q4_1" in kinds:
                return f"blk.{i} fuses Q8_0 with Q4_1 in {' + '.join(parts)}"
    return None


#: Our name of the LM head in the kept weights (the model's ``lm_head`` module).
LM_HEAD = "lm_head"


def read_llama_projections(gguf_file: str | Path, hf_config: Any, lm_head: str | None = None
                           ) -> dict[str, Int4Weight | Int8GroupWeight]:
    """Our module name (e.g. ``model.layers.0.self_attn.qkv_proj``) -> its kept weight, for
    every decoder projection; in a mixture-of-experts file (Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE: vllm_lite.models.gguf_moe) each expert's too (``mlp.experts.{e}.gate_up_proj``
    / ``down_proj``, cut from the stacked tensors: whole rows of blocks, exact). Routers
    are not projections: they load dequantized with the float weights. ValueError naming
    the tensor for a type this cannot keep.

    ``lm_head``: also the head (:data:`LM_HEAD`), from this tensor of the file (the model's
    own: ``output.weight``, or ``token_embd.weight`` for a head tied to the embedding), when
    its blocks are a kept type (the default model's tied head is Q8_0: a quarter of its
    float32 bytes, and llama.cpp computes the logits on those blocks too); another type
    (F16, Q6_K, ...) is left out, and the head stays in the model's dtype."""
    header = read_header(gguf_file)
    tensors, data = header.tensors, tensor_data(header)
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    permuted = not any(a in _UNPERMUTED for a in getattr(hf_config, "architectures", None) or ())

    def load(name: str, expert: int | None = None) -> Int4Weight | Int8GroupWeight:
        if name not in tensors:
            raise ValueError(f"{gguf_file}: no tensor {name!r} (not a Llama GGUF?)")
        t = tensors[name]
        kind = t.type_name
        if kind not in _BLOCK_BYTES:
            raise ValueError(
                f"quantization='gguf' keeps Q4_0, Q4_1 and Q8_0 projections; {name} is {kind} "
                f"(load it with quantization=None to dequantize)")
        cols, rows = (int(x) for x in t.shape[:2])  # ggml order: [K, N(, experts)]
        return _decode(kind, data[name] if expert is None else data[name][expert], rows, cols)

    out: dict[str, Int4Weight | Int8GroupWeight] = {}
    for i in range(hf_config.num_hidden_layers):
        blk, pre = f"blk.{i}.", f"model.layers.{i}."
        for parts in _layer_parts(tensors, i):
            ours = pre + _OURS[parts[0]]
            if parts[0] == "attn_q":
                q, k = load(blk + "attn_q.weight"), load(blk + "attn_k.weight")
                if permuted:
                    q, k = _unpermute_rows(q, n_head), _unpermute_rows(k, n_kv)
                out[ours] = _cat([q, k, load(blk + "attn_v.weight")], ours)
            elif parts[0].endswith("_exps"):
                experts = int(tensors[f"{blk}{parts[0]}.weight"].shape[2]) \
                    if f"{blk}{parts[0]}.weight" in tensors else 0
                for e in range(experts):
                    name = ours.format(e=e)
                    out[name] = _cat([load(f"{blk}{p}.weight", e) for p in parts], name)
            else:
                out[ours] = _cat([load(f"{blk}{p}.weight") for p in parts], ours)
    if lm_head in tensors and tensors[lm_head].type_name in _BLOCK_BYTES:
        out[LM_HEAD] = load(lm_head)
    return out
