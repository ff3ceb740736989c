"""torch.ops.vllm_lite.int8_linear (CPU): every build the CPU runs against a float64 matmul
on the dequantized weights: the row kernels (float32 up to 2 rows on AVX-512 builds, 32 on
the others; bfloat16 up to 32 rows on the AVX512-BF16 kernel), the packed tiles on a
dequantized panel above those (AVX-512 builds), the dequantize + GEMM path (other builds),
the float32 fallback of bfloat16; shapes that leave partial passes, tasks, row tiles,
panels and chunks of q's bytes, odd K, several row blocks; argument checks; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .reference import assert_rounded_once_to_bf16

# Relative to the largest |output|: float32 accumulation in another order.
RTOL = 2e-6


def _case(m: int, k: int, n: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.02 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    return x, q, scales, b


def _weight(q: torch.Tensor, packed: bool) -> torch.Tensor:
    """q as it is, or packed in panels (the layers' form on AVX-512 builds; elsewhere the op
    unpacks it per call)."""
    return ops.pack_linear_weight(q) if packed else q


PACKED = pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])


def _reference(x, q, scales, b):
    ref = x.double() @ (q.double() * scales.double()[:, None]).t()
    return ref + b.double() if b is not None else ref


# (rows, K, N): 1..32 rows run the block kernel (odd rows take its one-row tail) on builds
# without AVX-512, 33+ the dequantize path there; on AVX-512 builds 3+ rows run the packed
# tiles (K 30 and 1100: a last partial 32-byte chunk of each row; 600 rows of K 1100: three
# row blocks); N not a multiple of 4 (a short pass), 32 (a short task) or 48 (a partial
# panel).
SHAPES = [(1, 64, 32), (2, 64, 37), (3, 13, 5), (7, 576, 96), (16, 8, 1), (31, 72, 130),
          (32, 100, 64), (33, 64, 40), (100, 48, 70), (17, 30, 97), (600, 1100, 49),
          (4, 66, 50), (1, 577, 9)]


@PACKED
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(isa: str, m: int, k: int, n: int, bias: bool, packed: bool) -> None:
    x, q, scales, b = _case(m, k, n, seed=m * 1000 + n, bias=bias)
    y = ops.int8_linear(x, _weight(q, packed), scales, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert not torch.isnan(y).any()
    ref = _reference(x, q, scales, b)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=RTOL * float(ref.abs().max()) + 1e-7)


@PACKED
def test_leading_dims_and_strided_rows(isa: str, packed: bool) -> None:
    """x [2, 3, K] and x a column slice of a wider, NaN-filled tensor (rows strided):
    the columns outside the slice are never read."""
    x, q_rows, scales, b = _case(6, 40, 24, seed=5, bias=True)
    q = _weight(q_rows, packed)
    y = ops.int8_linear(x.reshape(2, 3, 40), q, scales, b)
    ref = _reference(x, q_rows, scales, b).reshape(2, 3, 24)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=RTOL * float(ref.abs().max()))
    wide = torch.full((6, 100), float("nan"))
    wide[:, 30:70] = x
    y = ops.int8_linear(wide[:, 30:70], q, scales, b)
    torch.testing.assert_close(y.double(), _reference(x, q_rows, scales, b), rtol=0,
                               atol=RTOL * float(ref.abs().max()))


# bfloat16 x: odd K (x padded by a zero column for the pairs), K not a multiple of 4 or 32,
# 1-4 rows (packed: dequantized in registers, no buffer), every row-tile size, several
# panels of 48 columns and a partial last one, and (200 rows of K 1536) two row blocks,
# each dequantizing the panels again.
BF16_SHAPES = SHAPES + [(5, 577, 9), (64, 1536, 40), (130, 96, 33), (1, 577, 9), (1, 100, 7),
                        (1, 72, 5), (9, 574, 150), (200, 1536, 100), (4, 66, 50)]


@PACKED
@pytest.mark.parametrize("m,k,n", BF16_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_matches_float64(isa: str, m: int, k: int, n: int, bias: bool,
                                  packed: bool) -> None:
    x, q, scales, b = _case(m, k, n, seed=m * 1000 + n + 7, bias=bias)
    xb = x.bfloat16()
    y = ops.int8_linear(xb, _weight(q, packed), scales, b)
    assert y.shape == (m, n)
    assert_rounded_once_to_bf16(y, _reference(xb, q, scales, b), RTOL)


@PACKED
def test_bfloat16_strided_rows_never_read_past_k(isa: str, packed: bool) -> None:
    """x a column slice (K = 40, a masked tail) of a NaN-filled bf16 tensor; x [2, 3, K]."""
    x, q, scales, b = _case(6, 40, 24, seed=9, bias=True)
    xb = x.bfloat16()
    wide = torch.full((6, 100), float("nan"), dtype=torch.bfloat16)
    wide[:, 30:70] = xb
    ref = _reference(xb, q, scales, b)
    q = _weight(q, packed)
    assert_rounded_once_to_bf16(ops.int8_linear(wide[:, 30:70], q, scales, b), ref, RTOL)
    y3 = ops.int8_linear(xb.reshape(2, 3, 40), q, scales, b)
    assert y3.shape == (2, 3, 24)
    assert_rounded_once_to_bf16(y3.reshape(6, 24), ref, RTOL)
    # One row (the one-row loop), NaN right after K.
    assert_rounded_once_to_bf16(ops.int8_linear(wide[2:3, 30:70], q, scales, b), ref[2:3],
                                RTOL)


def _group_case(m: int, k: int, n: int, group: int, seed: int, bias: bool):
    x, q, _, b = _case(m, k, n, seed, bias)
    g = torch.Generator().manual_seed(seed + 1)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-4
    return x, q, scales, b


def _group_reference(x, q, scales, b, weight_bf16: bool = False):
    """w = q * scales[n, k // G]: float32 (one rounding of the exact product), then bf16 for
    the AVX512-BF16 kernel."""
    n, k = q.shape
    w = (q.double().view(n, scales.shape[1], -1) * scales.double()[..., None]).view(n, k)
    w = w.float().bfloat16().double() if weight_bf16 else w.float().double()
    ref = x.double() @ w.t()
    return ref + b.double() if b is not None else ref


# Group-wise scales [N, K / G] (GGUF Q8_0): 1..32 rows on the block kernel, 33+ dequantized.
GROUP_SHAPES = [(1, 64, 37, 32), (3, 576, 96, 32), (7, 256, 70, 64), (32, 384, 40, 128),
                (33, 128, 24, 32), (130, 96, 33, 32), (200, 1536, 100, 32)]


@PACKED
@pytest.mark.parametrize("m,k,n,group", GROUP_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_scales_match_float64(isa: str, m: int, k: int, n: int, group: int,
                                    dtype: torch.dtype, packed: bool) -> None:
    x, q, scales, b = _group_case(m, k, n, group, seed=m * 100 + n, bias=True)
    xd = x.to(dtype)
    y = ops.int8_linear(xd, _weight(q, packed), scales, b)
    assert y.shape == (m, n) and y.dtype == dtype
    if dtype == torch.float32:
        ref = _group_reference(xd, q, scales, b)
        torch.testing.assert_close(y.double(), ref, rtol=0,
                                   atol=RTOL * float(ref.abs().max()) + 1e-7)
    else:
        ref = _group_reference(xd, q, scales, b, weight_bf16=isa in ("amxbf16", "avx512bf16"))
        assert_rounded_once_to_bf16(y, ref, RTOL)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [0, 32], ids=["channel", "groups"])
def test_packed_few_rows_equal_the_buffered_tiles(isa: str, dtype: torch.dtype,
                                                   group: int, bias: bool) -> None:
    """Up to kQuantFusedRows (4) rows (float32: 8, in passes of the tile's rows), the
    packed kernels dequantize each row of a panel in registers; more rows share a
    dequantized panel buffer. Both run the same products in the same k order and the same
    epilogue (scale and bias), so a row's output is the same bits either way (odd K:
    nothing read past a row, NaN there; K 97 and 3 panels, the last partial)."""
    if not ops.packed_quant_linear_kernel_selected():
        pytest.skip(f"the {isa} build has no packed quantized kernel")
    k = 96 if group else 97
    x, q, scales, b = (_group_case(9, k, 130, group, seed=4, bias=bias) if group
                       else _case(9, k, 130, seed=4, bias=bias))
    wide = torch.full((9, k + 8), float("nan"), dtype=dtype)  # NaN right after each row
    wide[:, :k] = x
    x, qp = wide[:, :k], _weight(q, True)
    many = ops.int8_linear(x, qp, scales, b)
    assert not torch.isnan(many).any()
    for m in range(1, 9):
        assert torch.equal(ops.int8_linear(x[:m], qp, scales, b), many[:m]), m


def test_empty_inputs() -> None:
    x, q, scales, _ = _case(0, 16, 8, seed=1, bias=False)
    assert ops.int8_linear(x, q, scales).shape == (0, 8)
    assert ops.int8_linear(x, ops.pack_linear_weight(q), scales).shape == (0, 8)


def test_packed_layout() -> None:
    """pack_linear_weight on an int8 qweight: [panels, K, 48], element (n // 48, k, n % 48)
    = q[n, k], zero past N."""
    _, q, _, _ = _case(1, 7, 50, seed=4, bias=False)
    p = ops.pack_linear_weight(q)
    assert p.shape == (2, 7, 48) and p.dtype == torch.int8
    for n in range(50):
        assert torch.equal(p[n // 48, :, n % 48], q[n])
    assert not p[1, :, 2:].any()


@pytest.mark.parametrize("what,args,match", [
    ("x dtype", lambda x, q, s, b: (x.double(), q, s, b), "x must be Float or BFloat16"),
    ("x half", lambda x, q, s, b: (x.half(), q, s, b), "x must be Float or BFloat16"),
    ("q dtype", lambda x, q, s, b: (x, q.to(torch.uint8), s, b), "qweight must be Char"),
    ("q dims", lambda x, q, s, b: (x, q[None, None], s, b), r"qweight must be \[N, K\] or packed"),
    ("q packed shape", lambda x, q, s, b: (x, q[None], s, b),
     r"packed qweight must be pack_linear_weight's \[ceil\(N / 48\), K, 48\]"),
    ("q packed panels", lambda x, q, s, b: (x, torch.cat([ops.pack_linear_weight(q)] * 2), s, b),
     r"packed qweight must be pack_linear_weight's"),
    ("q strided", lambda x, q, s, b: (x, q.t().contiguous().t(), s, b), "qweight must be contiguous"),
    ("K", lambda x, q, s, b: (x[:, :-1], q, s, b), "last dimension"),
    ("scales shape", lambda x, q, s, b: (x, q, s[:-1], b), "scales must be"),
    ("group of 8", lambda x, q, s, b: (x, q, s[:, None].expand(16, 2).contiguous(), b),
     r"scales must be \[N\] or \[N, K / G\] with G 32, 64 or 128"),
    ("scales 3-D", lambda x, q, s, b: (x, q, s[:, None, None], b), "scales must be"),
    ("scales dtype", lambda x, q, s, b: (x, q, s.half(), b), "scales must be Float"),
    ("bias shape", lambda x, q, s, b: (x, q, s, b[:-1]), "bias must be"),
    ("scalar x", lambda x, q, s, b: (x[0, 0], q, s, b), "at least 1 dimension"),
])
def test_bad_arguments(what: str, args, match: str) -> None:
    x, q, scales, b = _case(4, 16, 16, seed=2, bias=True)
    if what == "q strided":
        q = torch.randint(-5, 5, (16, 16), dtype=torch.int8)
    with pytest.raises(RuntimeError, match=match):
        ops.int8_linear(*args(x, q, scales, b))


@PACKED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype: torch.dtype, packed: bool) -> None:
    x, q, scales, b = _case(3, 16, 8, seed=3, bias=True)
    torch.library.opcheck(torch.ops.vllm_lite.int8_linear.default,
                          (x.to(dtype), _weight(q, packed), scales, b),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))
