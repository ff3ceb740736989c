"""Weight-only quantization of the decoder's projections, applied once at load.

``int8``: per output channel, symmetric: ``scale[n] = max_k |W[n, k]| / 127``,
``q[n, k] = round(W[n, k] / scale[n])`` in [-127, 127] (round half to even, as
``torch.round``). The weights take a quarter of float32's memory (half of bfloat16's),
and a memory-bound decode GEMM reads that much less. The GEMM:

- CPU: vllm_lite's own ``torch.ops.vllm_lite.int8_linear`` (csrc/cpu/int8_linear*.cpp;
  float32 or bfloat16 activations, bfloat16 on vdpbf16ps where the CPU has AVX512-BF16;
  float16 is converted to float32 and back). torch's
  ``_weight_int8pack_mm`` is slower than the float32 GEMM on CPUs, which defeats the point.
- other devices: torch's ``aten._weight_int8pack_mm(x [T, K], q [N, K], scale [N])``
  with x in the engine's dtype; where that op is missing for the device and dtype, the
  layer dequantizes once into a plain weight and warns (correct, no memory saving).

The embedding and the LM head stay in the activation dtype (as vLLM's weight-only
methods do): the head's logits feed the sampler, and a tied head is the embedding. The one
exception is ``gguf`` in float32 on the CPU (vllm_lite.worker.worker.gguf_head_tensor),
where the worker passes the file's own head blocks in ``kept_weights`` as llama.cpp runs
them (the embedding keeps its dequantized rows).

``int4``: groups of ``group_size`` (32, 64 or 128) consecutive input weights of a row share
a scale and a zero (asymmetric): ``scale = (max - min) / 15``, ``zero = min``, ``q =
round((w - zero) / scale)`` in 0..15, ``w ~= q * scale + zero``; an eighth of float32's
bytes plus the group's two floats. ``gguf``: the GGUF file's own Q4_0 / Q4_1 blocks in that
same form, exactly (vllm_lite.models.gguf_quant), group 32; ``gptq`` / ``awq``: a GPTQ or
AWQ checkpoint's 4-bit weights in that form, exactly (vllm_lite.models.gptq_awq; GPTQ
act-order as a column permutation of x). The GEMM:

- CPU: vllm_lite's ``torch.ops.vllm_lite.int4_linear`` (float32 or bfloat16 activations,
  like int8_linear; the bf16 kernel rounds each weight q * scale + zero to bfloat16, the
  weight of the dequantized bfloat16 model).
- other devices: dequantized once at load into the engine's dtype, with a warning
  (correct, no memory saving; torch's int4 GEMMs want other layouts); a mixture of
  experts' dequantized experts then run as one fused op again (FusedMoE).

GGUF Q8_0 projections (32 int8 weights per fp16 scale) keep their per-32 scales in
Int8GroupLinear (rescaling to one per row would round). On the CPU its GEMM is
``int8_linear`` with [N, K / 32] scales (the kernels widen q * scale); elsewhere torch code
dequantizes the weight (exactly) in row chunks of a few MB at each call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vllm_lite import ops
from vllm_lite.config.schema import DEFAULT_INT4_GROUP_SIZE, check_quantization
from vllm_lite.errors import InternalError
from vllm_lite.models.gguf_quant import Int4Weight, Int8GroupWeight, pack_nibbles

logger = logging.getLogger(__name__)

_WARNED: set[tuple[Any, ...]] = set()


def _warn_once(key: tuple[Any, ...], msg: str, *args: Any) -> None:
    """logger.warning once per process and key: a model's every projection (a mixture of
    experts has thousands) would repeat the same line."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg, *args)

_INT8_MAX = 127


def cpu_qweight(q: torch.Tensor) -> torch.Tensor:
    """A CPU layer's int8 [N, K] / int4 uint8 [N, K / 2] weight as its GEMM wants it: packed
    in panels of output columns (``ops.pack_linear_weight``) where the selected CPU build
    runs packed quantized weights (AVX2 and wider), so int8_linear / int4_linear run every row
    count on packed_linear's tiles, a panel dequantized at a time (measured against the row
    kernels in README "CPU kernels"); elsewhere as it is."""
    return ops.pack_linear_weight(q) if ops.packed_quant_linear_kernel_selected() else q


def qweight_rows(q: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, row] weight of ``q``, packed by :func:`cpu_qweight` or not (a copy if
    packed)."""
    if q.dim() == 3:
        return q.permute(0, 2, 1).reshape(-1, q.shape[1])[:n]
    return q


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]) with weight ~= q * scale[:, None]. An all-zero row
    gets scale 1 (q = 0), so no division by zero."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight [N, K] = q * scale[:, None]."""
    return q.float() * scale.float()[:, None]


def _int8_decode_form(layer: Int8Linear | Int8GroupLinear, dtype: torch.dtype
                      ) -> ops.DecodeForm | None:
    """What the layer's forward passes to ``ops.int8_linear`` for x of ``dtype`` (float32 /
    bf16 on the CPU), for ``ops.llama_decode_layers``; None elsewhere."""
    if not layer.on_cpu or dtype not in (torch.float32, torch.bfloat16):
        return None
    return layer.qweight, layer.scales, None, 0, layer._bias_f32


class Int8Linear(nn.Module):
    """A linear layer with an int8 per-channel weight; ``forward`` takes [..., K] in the
    engine's dtype and returns [..., N] in that dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dtype, device = linear.weight.dtype, linear.weight.device
        q, scale = quantize_int8(linear.weight)
        self.on_cpu = _int8_kernel_on(device)
        self.bias = linear.bias
        self._bias_f32 = (None if linear.bias is None or not self.on_cpu
                          else linear.bias.detach().float())
        # Set when the device has no int8 GEMM: the dequantized weight, used by F.linear. The
        # int8 copy is not kept beside it (it would cost half the dense weight's memory again
        # and nothing reads it), as Int4Linear keeps no nibbles when it dequantizes.
        self._dequantized: torch.Tensor | None = None
        if not self.on_cpu and not _int8_mm_works(device, dtype):
            _warn_once(("int8", device, dtype), "no int8 weight-only GEMM for %s %s in this "
                       "torch: dequantizing the weights at load (correct, no memory saving)",
                       device, dtype)
            self._dequantized = dequantize_int8(q, scale).to(device=device, dtype=dtype)
            return
        self.register_buffer("qweight", cpu_qweight(q) if self.on_cpu else q.to(device))
        # vllm_lite's CPU op takes float32 scales and bias; torch's op wants the scales in
        # the activation dtype.
        self.register_buffer("scales", scale.to(device=device,
                                                dtype=torch.float32 if self.on_cpu else dtype))

    def decode_form(self, dtype: torch.dtype) -> ops.DecodeForm | None:
        return _int8_decode_form(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            if x.dtype == torch.bfloat16:  # the op's own bf16 path (vdpbf16ps where the CPU has it)
                return ops.int8_linear(x, self.qweight, self.scales, self._bias_f32)
            y = ops.int8_linear(x.float(), self.qweight, self.scales, self._bias_f32)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if self._dequantized is not None:
            return nn.functional.linear(x, self._dequantized, self.bias)
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight,
                                               self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def qweight_rows(self) -> torch.Tensor:
        """The int8 weight [N, K] (``qweight`` may be packed for the CPU GEMM)."""
        return qweight_rows(self.qweight, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric group-wise int4 of ``weight`` [N, K] (K a multiple of group_size). A
    constant group gets scale 1 (q = 0, zero = its value), so no division by zero."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 quantization: in_features {k} is not a multiple of the "
                         f"group size {group_size}")
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(pack_nibbles(q.view(n, k)), scale.contiguous(), lo.contiguous(),
                      group_size)


def _int8_kernel_on(device: torch.device) -> bool:
    """Whether Int8Linear runs vllm_lite's int8 op on ``device`` (the CPU); elsewhere torch's
    int8 GEMM where it has one, else the weights dequantize at load."""
    return device.type == "cpu"


def _int4_kernel_on(device: torch.device) -> bool:
    """Whether int4 weights stay int4 on ``device`` (vllm_lite's CPU op); elsewhere they
    dequantize at load."""
    return device.type == "cpu"


class Int4Linear(nn.Module):
    """A linear layer with a group-wise int4 weight (:class:`Int4Weight`); ``forward``
    takes [..., K] in the engine's dtype and returns [..., N] in that dtype."""

    def __init__(self, linear: nn.Linear, weight: Int4Weight) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if weight.qweight.shape != (self.out_features, self.in_features // 2):
            raise InternalError(f"int4 weight {tuple(weight.qweight.shape)} does not fit a "
                                f"{self.out_features}x{self.in_features} linear layer")
        dtype, device = linear.weight.dtype, linear.weight.device
        self.group_size = weight.group_size
        self.on_cpu = _int4_kernel_on(device)
        self.bias = linear.bias
        self._dequantized: torch.Tensor | None = None
        # GPTQ act-order: the stored columns are x's in this order (groups contiguous);
        # None off the CPU, where dequantize() has already put them back in x's order.
        self.perm = weight.perm if self.on_cpu else None
        if not self.on_cpu:
            _warn_once(("int4", device), "int4 on %s: no int4 GEMM for this device yet; "
                       "dequantizing the weights at load (correct, no memory saving)", device)
            self._dequantized = weight.dequantize().to(device=device, dtype=dtype)
            return
        self.register_buffer("qweight", cpu_qweight(weight.qweight.contiguous()))
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("zeros", weight.zeros.float().contiguous())
        self._bias_f32 = None if linear.bias is None else linear.bias.detach().float()

    def decode_form(self, dtype: torch.dtype) -> ops.DecodeForm | None:
        """What forward passes to ``ops.int4_linear`` for x of ``dtype`` (float32 / bf16, no
        act-order permutation), for ``ops.llama_decode_layers``; None elsewhere."""
        if (self._dequantized is not None or self.perm is not None
                or dtype not in (torch.float32, torch.bfloat16)):
            return None
        return self.qweight, self.scales, self.zeros, self.group_size, self._bias_f32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dequantized is not None:
            return nn.functional.linear(x, self._dequantized, self.bias)
        # float32 and bfloat16 go to the op as they are (bf16 on vdpbf16ps where the CPU has
        # it); float16 through float32.
        xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        if self.perm is not None:
            xin = xin.index_select(-1, self.perm)
        y = ops.int4_linear(xin, self.qweight, self.scales, self.zeros, self.group_size,
                            self._bias_f32)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def qweight_rows(self) -> torch.Tensor:
        """The packed nibbles [N, K / 2] (``qweight`` may be packed in panels for the CPU
        GEMM)."""
        return qweight_rows(self.qweight, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"group_size={self.group_size}")


class Int8GroupLinear(nn.Module):
    """A linear layer with int8 weights in groups sharing a scale (GGUF Q8_0,
    :class:`Int8GroupWeight`); ``forward`` takes [..., K] in the engine's dtype and returns
    [..., N] in that dtype. CPU: ``int8_linear`` with [N, K / G] scales (float32 or bf16
    activations, as Int8Linear); elsewhere torch code dequantizing row chunks in float32."""

    #: float32 elements of weight dequantized at a time (16 MB): bounds the temporary.
    CHUNK_ELEMENTS = 1 << 22

    def __init__(self, linear: nn.Linear, weight: Int8GroupWeight) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if weight.qweight.shape != (self.out_features, self.in_features):
            raise InternalError(f"int8 group weight {tuple(weight.qweight.shape)} does not fit "
                                f"a {self.out_features}x{self.in_features} linear layer")
        device = linear.weight.device
        self.group_size = weight.group_size
        self.on_cpu = device.type == "cpu"
        q = weight.qweight.to(device).contiguous()
        self.register_buffer("qweight", cpu_qweight(q) if self.on_cpu else q)
        self.register_buffer("scales", weight.scales.to(device=device,
                                                        dtype=torch.float32).contiguous())
        self.bias = linear.bias
        self._bias_f32 = (None if linear.bias is None or not self.on_cpu
                          else linear.bias.detach().float())

    def decode_form(self, dtype: torch.dtype) -> ops.DecodeForm | None:
        return _int8_decode_form(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            y = ops.int8_linear(xin, self.qweight, self.scales, self._bias_f32)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        n, k = self.qweight.shape
        g = self.group_size
        xf = x.float().reshape(-1, k)
        y = torch.empty(xf.shape[0], n, dtype=torch.float32, device=x.device)
        step = max(1, self.CHUNK_ELEMENTS // k)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            w = (self.qweight[lo:hi].float().view(hi - lo, k // g, g)
                 * self.scales[lo:hi, :, None]).view(hi - lo, k)
            torch.matmul(xf, w.T, out=y[:, lo:hi])
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def qweight_rows(self) -> torch.Tensor:
        """The int8 weight [N, K] (``qweight`` may be packed for the CPU GEMM)."""
        return qweight_rows(self.qweight, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8, "
                f"group_size={self.group_size}")


_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _int8_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether aten._weight_int8pack_mm runs for this device type and activation dtype
    (probed once on a tiny problem)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        try:
            x = torch.ones(1, 32, dtype=dtype, device=device)
            q = torch.ones(8, 32, dtype=torch.int8, device=device)
            s = torch.ones(8, dtype=dtype, device=device)
            _PROBED[key] = bool(torch.ops.aten._weight_int8pack_mm(x, q, s).shape == (1, 8))
        except (RuntimeError, NotImplementedError, AttributeError):
            _PROBED[key] = False
    return _PROBED[key]


def quantize_model(model: nn.Module, method: str | None, skip: tuple[nn.Module, ...] = (),
                   group_size: int | None = None,
                   kept_weights: dict[str, Int4Weight | Int8GroupWeight] | None = None) -> int:
    """Replaces every nn.Linear of ``model`` but those in ``skip`` (the LM head) by its
    quantized form, in place, a mixture of experts' routed experts included (each
    :class:`~vllm_lite.layers.moe.FusedMoE` split first); returns how many were replaced.
    None: nothing changes.
    ``group_size``: int4's (default DEFAULT_INT4_GROUP_SIZE); ``kept_weights``: the
    checkpoint's own quantized projections by module name, for "gguf"
    (vllm_lite.models.gguf_quant.read_llama_projections) and "gptq" / "awq"
    (vllm_lite.models.gptq_awq.read_checkpoint_projections), every one of which must find its
    layer."""
    if check_quantization(method) is None:
        return 0
    from vllm_lite.layers.moe import FusedMoE

    # A mixture of experts' routed experts (most of its weights) become one module per
    # expert whose projections are nn.Linear views of the fused weights; the loop below
    # quantizes them like the dense projections (``...mlp.experts.{e}.gate_up_proj``).
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedMoE):
                setattr(parent, name, child.split())
    targets = [(parent, f"{pname}.{name}" if pname else name, name, child)
               for pname, parent in model.named_modules()
               for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and not any(child is s for s in skip)]
    if method in ("gguf", "gptq", "awq"):
        if kept_weights is None:
            raise ValueError(f"quantization={method!r} needs the checkpoint's quantized "
                             f"projections (a GGUF model for gguf, a {method} checkpoint for "
                             f"gptq / awq)")
        found = {full for _, full, _, _ in targets}
        missing = sorted(set(kept_weights) - found)
        if missing:
            raise InternalError(f"{method} projections with no matching layer: {missing[:3]}")
        targets = [t for t in targets if t[1] in kept_weights]
    for parent, full, name, child in targets:
        if method == "int8":
            layer: nn.Module = Int8Linear(child)
        elif method == "int4":
            layer = Int4Linear(child, quantize_int4(child.weight,
                                                    group_size or DEFAULT_INT4_GROUP_SIZE))
        else:
            kept = kept_weights[full]  # type: ignore[index]
            layer = (Int8GroupLinear(child, kept) if isinstance(kept, Int8GroupWeight)
                     else Int4Linear(child, kept))
        setattr(parent, name, layer)
    _fuse_dequantized_experts(model)
    return len(targets)


def _fuse_dequantized_experts(model: nn.Module) -> None:
    """Off the CPU the int4 formats (and int8 where torch has no int8 GEMM for the device)
    dequantize each projection at load: a mixture of experts whose experts all did is one
    FusedMoE again, so the fused op runs it rather than a GEMM per expert (the same weights,
    no memory lost: they were dense already)."""
    from vllm_lite.layers.moe import SplitExperts

    def dense(layer: nn.Module) -> torch.Tensor | None:
        if not isinstance(layer, (Int8Linear, Int4Linear)) or layer.bias is not None:
            return None
        return layer._dequantized

    layers = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, SplitExperts):
                continue
            experts = [child.expert(e) for e in range(child.num_experts)]
            up = [dense(ex.gate_up_proj) for ex in experts]
            down = [dense(ex.down_proj) for ex in experts]
            if any(w is None for w in up + down):
                continue
            fused = child.fused(torch.stack(up), torch.stack(down))  # type: ignore[arg-type]
            setattr(parent, name, fused)
            layers += 1
    if layers:
        logger.info("%d mixture-of-experts layers: their experts, dequantized at load, run "
                    "as one fused op each", layers)
