"""torch.ops.vllm_lite.int4_linear (CPU): every build the CPU runs (the row kernels, the
packed tiles on a dequantized panel on AVX-512 builds, the dequantize + GEMM path on the
others; the row limits are int8_linear's) against a float64 matmul on weights dequantized
here from the packed nibbles; the default model's shapes, every group size, partial passes,
tasks and panels, several row blocks, strided rows; argument checks; torch.compile through
the fake."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .reference import assert_rounded_once_to_bf16

# Relative to the largest |output|: float32 accumulation in another order, and the kernel
# folds scale and zero into float32 weights before the dot product.
RTOL = 4e-6


def _case(m: int, k: int, n: int, group: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-4
    zeros = (torch.rand(n, k // group, generator=g) - 0.5) * 0.2
    b = torch.randn(n, generator=g) if bias else None
    return x, packed, scales, zeros, b


PACKED = pytest.mark.parametrize("in_panels", [False, True], ids=["rows", "panels"])


def _weight(packed: torch.Tensor, in_panels: bool) -> torch.Tensor:
    """The nibbles as they are, or in pack_linear_weight's panels (the layers' form on
    AVX-512 builds; elsewhere the op unpacks them per call)."""
    return ops.pack_linear_weight(packed) if in_panels else packed


def _reference(x, packed, scales, zeros, group, b, weight_bf16: bool = False):
    """weight_bf16: each weight q * scale + zero rounded (once) to float32, then to bfloat16,
    as the AVX512-BF16 kernel widens it."""
    n = packed.shape[0]
    q = torch.empty(n, packed.shape[1] * 2, dtype=torch.float64)
    q[:, 0::2] = (packed & 15).double()  # k = 2j: the low nibble of byte j
    q[:, 1::2] = (packed >> 4).double()
    w = q.view(n, -1, group) * scales.double()[..., None] + zeros.double()[..., None]
    if weight_bf16:
        w = w.float().bfloat16().double()
    ref = x.double() @ w.view(n, -1).t()
    return ref + b.double() if b is not None else ref


# (rows, K, N, group): the default model's projections (K 576 / 1536; N 960 = qkv,
# 576 = o, 3072 = gate_up, 576 = down), 1..32 rows on the block kernel, 33 and 64 on the
# dequantize path (the packed tiles from 3 float32 / 33 bfloat16 rows on AVX-512 builds;
# 200 rows of K 1536: two row blocks), N not a multiple of 4, 32 or 48.
SHAPES = [(1, 576, 960, 32), (2, 576, 576, 64), (3, 1536, 576, 128), (7, 576, 3072, 32),
          (32, 128, 37, 64), (1, 64, 5, 32), (33, 576, 192, 32), (64, 256, 130, 128),
          (200, 1536, 100, 32), (9, 96, 49, 32), (4, 64, 50, 32)]


@PACKED
@pytest.mark.parametrize("m,k,n,group", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(isa: str, m: int, k: int, n: int, group: int, bias: bool,
                         in_panels: bool) -> None:
    x, packed, scales, zeros, b = _case(m, k, n, group, seed=m * 1000 + n, bias=bias)
    y = ops.int4_linear(x, _weight(packed, in_panels), scales, zeros, group, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert not torch.isnan(y).any()
    ref = _reference(x, packed, scales, zeros, group, b)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=RTOL * float(ref.abs().max()) + 1e-7)


@PACKED
@pytest.mark.parametrize("m,k,n,group", SHAPES + [(130, 96, 33, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_matches_float64(isa: str, m: int, k: int, n: int, group: int,
                                  bias: bool, in_panels: bool) -> None:
    """bf16 x: the AVX512-BF16 kernel rounds each widened weight to bf16 (the dequantized
    bf16 model's weight); the other builds run the float32 kernel on x converted."""
    x, packed, scales, zeros, b = _case(m, k, n, group, seed=m * 1000 + n + 7, bias=bias)
    xb = x.bfloat16()
    y = ops.int4_linear(xb, _weight(packed, in_panels), scales, zeros, group, b)
    assert y.shape == (m, n)
    ref = _reference(xb, packed, scales, zeros, group, b, weight_bf16=isa in ("amxbf16", "avx512bf16"))
    assert_rounded_once_to_bf16(y, ref, RTOL)


@PACKED
def test_bfloat16_strided_rows(isa: str, in_panels: bool) -> None:
    x, packed, scales, zeros, b = _case(6, 64, 24, 32, seed=8, bias=True)
    xb = x.bfloat16()
    wide = torch.full((6, 100), float("nan"), dtype=torch.bfloat16)
    wide[:, 30:94] = xb
    y = ops.int4_linear(wide[:, 30:94], _weight(packed, in_panels), scales, zeros, 32, b)
    ref = _reference(xb, packed, scales, zeros, 32, b, weight_bf16=isa in ("amxbf16", "avx512bf16"))
    assert_rounded_once_to_bf16(y, ref, RTOL)


@PACKED
def test_leading_dims_and_strided_rows(isa: str, in_panels: bool) -> None:
    x, packed, scales, zeros, b = _case(6, 64, 24, 32, seed=5, bias=True)
    ref = _reference(x, packed, scales, zeros, 32, b)
    packed = _weight(packed, in_panels)
    atol = RTOL * float(ref.abs().max())
    y = ops.int4_linear(x.reshape(2, 3, 64), packed, scales, zeros, 32, b)
    torch.testing.assert_close(y.double(), ref.reshape(2, 3, 24), rtol=0, atol=atol)
    wide = torch.full((6, 100), float("nan"))
    wide[:, 30:94] = x
    y = ops.int4_linear(wide[:, 30:94], packed, scales, zeros, 32, b)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_packed_few_rows_equal_the_buffered_tiles(isa: str, dtype: torch.dtype) -> None:
    """1-4 rows: each row of a panel dequantized in registers; more: a dequantized panel
    buffer. The same products in the same k order, so the same bits (3 panels, the last
    partial; NaN right after each row of x)."""
    if not ops.packed_quant_linear_kernel_selected():
        pytest.skip(f"the {isa} build has no packed quantized kernel")
    x, packed, scales, zeros, _ = _case(9, 128, 130, 32, seed=6, bias=False)
    wide = torch.full((9, 136), float("nan"), dtype=dtype)
    wide[:, :128] = x
    x, packed = wide[:, :128], _weight(packed, True)
    many = ops.int4_linear(x, packed, scales, zeros, 32, None)
    assert not torch.isnan(many).any()
    for m in range(1, 5):
        assert torch.equal(ops.int4_linear(x[:m], packed, scales, zeros, 32, None), many[:m]), m


def test_packed_layout() -> None:
    """pack_linear_weight on int4_linear's nibbles: [panels, K / 2, 48], element (n // 48,
    j, n % 48) = byte j of row n, zero past N."""
    _, packed, _, _, _ = _case(1, 64, 50, 32, seed=4, bias=False)
    p = ops.pack_linear_weight(packed)
    assert p.shape == (2, 32, 48) and p.dtype == torch.uint8
    for n in range(50):
        assert torch.equal(p[n // 48, :, n % 48], packed[n])
    assert not p[1, :, 2:].any()


@PACKED
def test_traces_under_torch_compile(in_panels: bool) -> None:
    x, packed, scales, zeros, _ = _case(4, 64, 8, 32, seed=3, bias=False)
    packed = _weight(packed, in_panels)
    f = torch.compile(lambda t: ops.int4_linear(t, packed, scales, zeros, 32) * 2,
                      fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), ops.int4_linear(x, packed, scales, zeros, 32) * 2)


@pytest.mark.parametrize("what,change,match", [
    ("x dtype", lambda a: a.update(x=a["x"].double()), "x must be Float or BFloat16"),
    ("x half", lambda a: a.update(x=a["x"].half()), "x must be Float or BFloat16"),
    ("qweight dtype", lambda a: a.update(qweight=a["qweight"].to(torch.int8)), "qweight must be Byte"),
    ("qweight shape", lambda a: a.update(qweight=a["qweight"][:, :-1].contiguous()), "qweight must be"),
    ("qweight dims", lambda a: a.update(qweight=a["qweight"][None, None]), "qweight must be"),
    ("packed panels", lambda a: a.update(qweight=ops.pack_linear_weight(a["qweight"])[:, :, :40].contiguous()),
     r"packed qweight must be pack_linear_weight's \[ceil\(N / 48\), K / 2, 48\]"),
    ("packed K", lambda a: a.update(qweight=ops.pack_linear_weight(a["qweight"])[:, :-1].contiguous()),
     "qweight must be"),
    ("qweight strided", lambda a: a.update(qweight=a["qweight"].t().contiguous().t()), "qweight must be contiguous"),
    ("group", lambda a: a.update(group_size=16), "group_size must be 32, 64 or 128"),
    ("group divides K", lambda a: a.update(group_size=128), "multiple of group_size"),
    ("scales shape", lambda a: a.update(scales=a["scales"][:, :1].contiguous()), "scales must be"),
    ("zeros dtype", lambda a: a.update(zeros=a["zeros"].double()), "zeros must be Float"),
    ("bias shape", lambda a: a.update(bias=torch.zeros(3)), "bias must be"),
])
def test_bad_arguments(what: str, change, match: str) -> None:
    x, packed, scales, zeros, b = _case(2, 64, 8, 32, seed=1, bias=True)
    args = dict(x=x, qweight=packed, scales=scales, zeros=zeros, group_size=32, bias=b)
    change(args)
    with pytest.raises(RuntimeError, match=f"int4_linear: .*{match}"):
        ops.int4_linear(**args)
