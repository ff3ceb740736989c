"""GPTQ and AWQ checkpoints (``quantization="gptq"`` / ``"awq"``): 4-bit Hugging Face
folders whose config.json has a ``quantization_config``, kept 4-bit in
:class:`~vllm_lite.models.gguf_quant.Int4Weight` form (Int4Linear), exactly.

Tensor formats, per linear layer ``prefix`` with in_features K, out_features N, group g:

- GPTQ (AutoGPTQ / GPTQModel "gptq" checkpoint format): ``qweight`` int32 [K / 8, N],
  packed along K (bits 4j..4j+3 of qweight[i, n] hold q[8i + j, n]); ``qzeros`` int32
  [K / g, N / 8], packed along N the same way; ``scales`` fp16 [K / g, N]; ``g_idx`` int32
  [K], the group of each input column (act-order, desc_act: not sorted). The stored zero
  is one less than the zero used (the classic format's off-by-one; checkpoint_format
  "gptq_v2" stores it as is): w[n, k] = scales[G, n] * (q[k, n] - (z[G, n] + 1)), G =
  g_idx[k]. sym=True checkpoints store z + 1 = 8.
- AWQ (AutoAWQ "gemm" version): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32
  [K / g, N / 8], both packed along N in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7]
  (nibble j of a word holds column 8c + order[j]); ``scales`` fp16 [K / g, N]; no
  offset: w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n]).

Int4Linear's form is w = q * scale + zero per group of consecutive stored columns, so zero
= -z * scale (exact in float32: a 5-bit integer times an fp16). Act-order GPTQ groups are
not consecutive input columns: the columns are stored sorted by g_idx (a stable sort, so
each group is a contiguous run of g) and the layer gathers x's columns in that order.
q / k / v (and gate / up) see the same input, so GPTQ gives them the same g_idx and they
fuse; a checkpoint where they differ is refused.

The float model is loaded from these tensors dequantized (:func:`dequantized_weights`),
then the worker swaps in the exact 4-bit layers (:func:`read_checkpoint_projections`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_lite.config.schema import INT4_GROUP_SIZES
from vllm_lite.models.gguf_quant import Int4Weight, cat_rows, pack_nibbles

#: The checkpoint methods this module reads (config.json quantization_config.quant_method).
CHECKPOINT_METHODS = ("gptq", "awq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class QuantSpec:
    method: str       # "gptq" | "awq"
    group_size: int
    zero_offset: int  # added to the stored zeros: 1 for classic GPTQ, else 0


def _quant_config(folder: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # read_hf_config reports a bad config.json
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return qc if isinstance(qc, dict) else None


def checkpoint_method(folder: str | Path) -> str | None:
    """The quant_method config.json names ("gptq", "awq", another string) or None."""
    qc = _quant_config(Path(folder))
    method = None if qc is None else qc.get("quant_method")
    return str(method).lower() if method is not None else None


def read_spec(folder: str | Path) -> QuantSpec | None:
    """The checked quantization_config of a GPTQ / AWQ folder; None for any other folder.
    A setting this cannot run exactly is a ValueError naming the field."""
    folder = Path(folder)
    qc = _quant_config(folder)
    method = checkpoint_method(folder)
    if qc is None or method not in CHECKPOINT_METHODS:
        return None
    where = f"{folder / 'config.json'}: quantization_config"
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits must be 4 for {method}, got {bits!r}")
    group = qc.get("group_size", qc.get("q_group_size"))
    if isinstance(group, bool) or group not in INT4_GROUP_SIZES:
        raise ValueError(f"{where}.group_size must be one of {list(INT4_GROUP_SIZES)} "
                         f"(Int4Linear's groups), got {group!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {version!r} is not supported (only 'gemm')")
        if qc.get("zero_point", True) is not True:
            raise ValueError(f"{where}.zero_point must be true (AWQ gemm checkpoints have "
                             f"zeros), got {qc.get('zero_point')!r}")
        return QuantSpec("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported "
                         f"(gptq or gptq_v2)")
    return QuantSpec("gptq", group, 1 if fmt == "gptq" else 0)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along rows (GPTQ qweight) -> uint8 [8 R, C]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] packed along columns -> uint8 [R, 8 C]; nibble j holds column 8c +
    order[j] (None: j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((packed[:, :, None] >> shifts) & 0xF).to(torch.uint8)  # [R, C, nibble]
    if order is not None:
        q = q[:, :, torch.argsort(torch.tensor(order))]  # nibble j -> column order[j]
    return q.reshape(packed.shape[0], -1)


def unpack(spec: QuantSpec, name: str, tensors: dict[str, torch.Tensor]) -> Int4Weight:
    """The layer ``name``'s qweight / qzeros / scales (/ g_idx) -> Int4Weight, exactly.
    Mis-shaped tensors are a ValueError naming them."""
    try:
        qweight, qzeros, scales = (tensors[p] for p in _PARTS[:3])
    except KeyError as e:
        raise ValueError(f"{name}: missing {e.args[0]} in the {spec.method} checkpoint") from None
    g = spec.group_size
    if spec.method == "awq":
        q = _unpack_cols(qweight.to(torch.int32), _AWQ_ORDER)           # [K, N]
        z = _unpack_cols(qzeros.to(torch.int32), _AWQ_ORDER)            # [K / g, N]
    else:
        q = _unpack_rows(qweight.to(torch.int32))                       # [K, N]
        z = _unpack_cols(qzeros.to(torch.int32), None)                  # [K / g, N]
    k, n = q.shape
    if k % g or scales.shape != (k // g, n) or z.shape != (k // g, n):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} "
                         f"do not fit a {k}x{n} weight with group_size {g}")
    scale = scales.float()
    zero = -(z.float() + spec.zero_offset) * scale                      # [K / g, N]
    perm = None
    g_idx = tensors.get("g_idx")
    if spec.method == "gptq" and g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // g:
            raise ValueError(f"{name}: g_idx must hold {k} group numbers in 0..{k // g - 1}")
        order = torch.sort(g_idx, stable=True).indices
        if not torch.equal(g_idx[order], torch.arange(k) // g):
            raise ValueError(f"{name}: g_idx must put exactly group_size {g} columns in each "
                             f"group")
        if not torch.equal(order, torch.arange(k)):
            perm = order
            q = q[order]
    return Int4Weight(pack_nibbles(q.T.contiguous()), scale.T.contiguous(),
                      zero.T.contiguous(), g, perm)


def _grouped(weights: Iterator[tuple[str, torch.Tensor]], spec: QuantSpec
             ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """The checkpoint's tensors with each quantized layer's parts (in whatever order the
    files hold them) replaced by one ``prefix.weight`` Int4Weight, once all have come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in _PARTS[:3]) and (spec.method == "awq" or "g_idx" in parts):
            yield prefix + ".weight", unpack(spec, prefix, pending.pop(prefix))
    for prefix, parts in pending.items():  # GPTQ layers without g_idx, or incomplete ones
        yield prefix + ".weight", unpack(spec, prefix, parts)


def dequantized_weights(weights: Iterator[tuple[str, torch.Tensor]], spec: QuantSpec
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as float weights (each quantized layer's ``prefix.weight``
    dequantized), for the model's ordinary load_weights."""
    for name, t in _grouped(weights, spec):
        yield name, t.dequantize() if isinstance(t, Int4Weight) else t


def read_checkpoint_projections(folder: str | Path, hf_config: Any) -> dict[str, Int4Weight]:
    """Our module name (``model.layers.0.self_attn.qkv_proj``) -> its Int4Weight, for every
    decoder projection of the GPTQ / AWQ checkpoint ``folder`` (a mixture of experts': each
    expert's, ``model.layers.0.mlp.experts.3.gate_up_proj``). Mixtures the model cannot
    run exactly (a quantized LM head, a float projection) are a ValueError."""
    from vllm_lite.models.loader import iterate_weights

    spec = read_spec(folder)
    if spec is None:
        raise ValueError(f"{folder} is not a GPTQ or AWQ checkpoint (config.json has no "
                         f"quantization_config with quant_method gptq / awq)")
    kept = {name[:-len(".weight")]: t for name, t in _grouped(iterate_weights(folder), spec)
            if isinstance(t, Int4Weight)}
    return _fuse_projections(kept, hf_config, f"{folder}", spec.method)


def _fuse_projections(kept: dict[str, Int4Weight], hf_config: Any, where: str,
                      method: str) -> dict[str, Int4Weight]:
    """The checkpoint's per-projection weights (HF module names) -> our fused layers'
    (q | k | v, gate | up; a mixture of experts' per expert ``mlp.experts.{e}.gate_up_proj``
    / ``down_proj``, its shared expert's like a dense MLP's). A projection missing or left
    over is a ValueError."""
    from vllm_lite.models.moe import MoeForCausalLM
    from vllm_lite.models.registry import get_model_class

    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    moe = model_cls if issubclass(model_cls, MoeForCausalLM) else None
    if moe is not None:
        kept = {moe.checkpoint_name(name): t for name, t in kept.items()}

    def mlp(prefix: str, names: tuple[str, str, str]) -> dict[str, tuple[str, ...]]:
        return {f"{prefix}.gate_up_proj": (f"{prefix}.{names[0]}", f"{prefix}.{names[1]}"),
                f"{prefix}.down_proj": (f"{prefix}.{names[2]}",)}

    dense = ("gate_proj", "up_proj", "down_proj")
    out: dict[str, Int4Weight] = {}
    for i in range(hf_config.num_hidden_layers):
        fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",)}
        if moe is None or not moe.is_sparse(hf_config, i):
            fused.update(mlp("mlp", dense))
        else:
            for e in range(getattr(hf_config, moe.num_experts_field)):
                fused.update(mlp(f"mlp.experts.{e}", moe.expert_projections))
            if moe.has_shared_expert:
                fused.update(mlp("mlp.shared_expert", dense))
        pre = f"model.layers.{i}."
        for ours, parts in fused.items():
            missing = [pre + p for p in parts if pre + p not in kept]
            if missing:
                raise ValueError(f"{where}: {missing[0]} is not {method}-quantized "
                                 f"(no qweight)")
            out[pre + ours] = cat_rows([kept.pop(pre + p) for p in parts], pre + ours)
    if kept:
        raise ValueError(f"{where}: quantized layers this model has no place for: "
                         f"{sorted(kept)[:3]}")
    return out


def checkpoint_quantization(requested: str | None, folder: str | Path) -> str | None:
    """The quantization a model folder runs with: a GPTQ / AWQ checkpoint's own method when
    ``requested`` is None or the same (its config checked); ValueError naming the field
    when they differ, when gptq / awq is asked of another folder, or for a checkpoint
    quantized by a method this engine cannot read."""
    method = checkpoint_method(folder)
    if method in CHECKPOINT_METHODS:
        read_spec(folder)
        if requested not in (None, method):
            raise ValueError(f"quantization={requested!r}, but {folder} is a {method} "
                             f"checkpoint (use quantization={method!r} or None)")
        return method
    if method is not None:
        raise ValueError(f"{Path(folder) / 'config.json'}: quantization_config.quant_method "
                         f"{method!r} is not supported (gptq or awq)")
    if requested in CHECKPOINT_METHODS:
        raise ValueError(f"quantization={requested!r} loads a {requested} checkpoint, but "
                         f"{folder}'s config.json has no quantization_config with quant_method "
                         f"{requested!r}")
    return requested
