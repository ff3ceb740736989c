"""torch.ops.vllm_lite.pack_linear_weight / packed_linear (CPU), float32 and bfloat16: every
CPU build this machine runs (the AVX-512 / AVX512-BF16 kernels where selected, at::linear
on the unpacked weight elsewhere) against a float64 matmul on the same values, on fresh
random inputs: row counts that leave every row-tile tail, N that ends mid-panel and
mid-vector, several panels per thread, strided and NaN-surrounded rows, leading dims;
argument checks; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .reference import assert_rounded_once_to_bf16

# Relative to the largest |output|: float32 accumulation in another order.
RTOL = 4e-6
DTYPES = [torch.float32, torch.bfloat16]


def _case(m: int, k: int, n: int, seed: int, bias: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _reference(x, w, b):
    ref = x.double() @ w.double().t()
    return ref + b.double() if b is not None else ref


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    if y.dtype == torch.bfloat16:
        assert_rounded_once_to_bf16(y, ref, RTOL)
    else:
        assert y.dtype == torch.float32 and not torch.isnan(y).any()
        torch.testing.assert_close(y.double(), ref, rtol=0,
                                   atol=RTOL * float(ref.abs().max()) + 1e-7)


# (rows, K, N): rows 1..9 and 15, 17, 31 leave each tail of the 8-row tile; N = 48 panels,
# N mid-panel (mid-vector or on a vector edge: 7, 16, 40, 100, 130, 1000) and many panels.
SHAPES = [(1, 2, 1), (1, 64, 48), (2, 64, 7), (3, 96, 16), (4, 576, 40), (5, 100, 100),
          (6, 32, 130), (7, 576, 960), (8, 64, 49), (9, 1536, 576), (15, 128, 1000),
          (17, 576, 96), (31, 576, 3072), (64, 200, 50), (300, 96, 144),
          (700, 1536, 50)]  # several row blocks (packed_row_block), the last one short


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_matches_float64(isa: str, m: int, k: int, n: int, bias: bool, dtype) -> None:
    x, w, b = _case(m, k, n, seed=m * 1000 + n + k, bias=bias, dtype=dtype)
    packed = ops.pack_linear_weight(w)
    assert packed.dtype == dtype
    assert packed.shape[1:] == ((k // 2, 48, 2) if dtype == torch.bfloat16 else (k, 48))
    y = ops.packed_linear(x, packed, b, n)
    assert y.shape == (m, n)
    _check(y, _reference(x, w, b))


@pytest.mark.parametrize("k", [1, 3, 577])
def test_float32_odd_k(isa: str, k: int) -> None:
    x, w, b = _case(10, k, 50, seed=k, bias=True, dtype=torch.float32)
    _check(ops.packed_linear(x, ops.pack_linear_weight(w), b, 50), _reference(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_packed_layout(dtype) -> None:
    """bf16 [panel, j, c, e] = W[48 panel + c, 2 j + e]; float32 [panel, k, c] =
    W[48 panel + c, k]; zeros past N."""
    _, w, _ = _case(1, 6, 50, seed=4, bias=False, dtype=dtype)
    packed = ops.pack_linear_weight(w)
    padded = torch.cat([w, torch.zeros(46, 6, dtype=dtype)])  # 96 rows = 2 panels
    for p in range(2):
        for c in range(48):
            for k in range(6):
                got = packed[p, k // 2, c, k % 2] if dtype == torch.bfloat16 else packed[p, k, c]
                assert got == padded[48 * p + c, k]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_leading_dims_and_strided_rows(isa: str, dtype) -> None:
    """x a column slice of a NaN-filled tensor (rows strided; the columns around it never
    read), x [2, 3, K], and column-major x."""
    x, w, b = _case(6, 40, 70, seed=5, bias=True, dtype=dtype)
    packed = ops.pack_linear_weight(w)
    ref = _reference(x, w, b)
    wide = torch.full((6, 100), float("nan"), dtype=dtype)
    wide[:, 30:70] = x
    _check(ops.packed_linear(wide[:, 30:70], packed, b, 70), ref)
    y3 = ops.packed_linear(x.reshape(2, 3, 40), packed, b, 70)
    assert y3.shape == (2, 3, 70)
    _check(y3.reshape(6, 70), ref)
    xt = torch.randn(40, 6).to(dtype).t()
    _check(ops.packed_linear(xt, packed, b, 70), _reference(xt, w, b))


def test_empty_rows() -> None:
    _, w, _ = _case(1, 16, 8, seed=1, bias=False, dtype=torch.bfloat16)
    assert ops.packed_linear(torch.empty(0, 16, dtype=torch.bfloat16),
                             ops.pack_linear_weight(w), None, 8).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_linear_layer_uses_it(dtype) -> None:
    """models.llama.Linear: packed_linear's copy where the kernel is selected (no oneDNN
    copy), results as the op's; not for a float32 weight that may be shared."""
    from vllm_lite.models.llama import Linear

    torch.manual_seed(6)
    lin = Linear(96, 100, bias=True).to(dtype)
    lin.prepare_for_cpu()
    if not ops.packed_linear_kernel_selected(dtype):
        assert lin._own_packed is None
        pytest.skip(f"CPU build {ops.cpu_isa()}: no {dtype} kernel, Linear keeps oneDNN")
    assert lin._own_packed is not None and lin._packed is None
    x = torch.randn(5, 96).to(dtype)
    with torch.no_grad():
        y = lin(x)
    _check(y, _reference(x, lin.weight, lin.bias.float()))
    lin.prepare_for_cpu(copy_float32=False)
    assert (lin._own_packed is None) == (dtype == torch.float32)


@pytest.mark.parametrize("what,args,match", [
    ("x dtype", lambda x, p, b, n: (x.double(), p, b, n), "x must be Float or BFloat16"),
    ("x other dtype", lambda x, p, b, n: (x.float(), p, b, n), "packed_weight must be Float"),
    ("scalar x", lambda x, p, b, n: (x[0, 0], p, b, n), "at least 1 dimension"),
    ("K", lambda x, p, b, n: (x[:, :-2], p, b, n), "last dimension"),
    ("packed dtype", lambda x, p, b, n: (x, p.float(), b, n), "packed_weight must be BFloat16"),
    ("packed dims", lambda x, p, b, n: (x, p[0], b, n), "packed_weight must be 4-D"),
    ("packed strided", lambda x, p, b, n: (x, torch.stack([p, p], -1)[..., 0], b, n),
     "packed_weight must be contiguous"),
    ("panel width", lambda x, p, b, n: (x, p[:, :, :16].contiguous(), b, n), "pack_linear_weight's"),
    ("out_features", lambda x, p, b, n: (x, p, None, n + 48), "out_features"),
    ("out_features 0", lambda x, p, b, n: (x, p, None, 0), "out_features"),
    ("bias shape", lambda x, p, b, n: (x, p, b[:-1], n), "bias must be"),
    ("bias dtype", lambda x, p, b, n: (x, p, b.bfloat16(), n), "bias must be Float"),
])
def test_bad_arguments(what: str, args, match: str) -> None:
    x, w, b = _case(4, 16, 20, seed=2, bias=True, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        ops.packed_linear(*args(x, ops.pack_linear_weight(w), b, 20))


def test_bad_arguments_float32() -> None:
    x, w, b = _case(4, 16, 20, seed=2, bias=True, dtype=torch.float32)
    packed = ops.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="packed_weight must be 3-D"):
        ops.packed_linear(x, packed[None], b, 20)
    with pytest.raises(RuntimeError, match="last dimension"):
        ops.packed_linear(x[:, :-1], packed, b, 20)


@pytest.mark.parametrize("weight,match", [
    (torch.zeros(4, 5, dtype=torch.bfloat16), "K even"),
    (torch.zeros(4, 6, dtype=torch.float64), "weight must be Float or BFloat16"),
    (torch.zeros(4, dtype=torch.bfloat16), "weight must be 2-D"),
    (torch.zeros(0, 6), "N >= 1"),
    (torch.zeros(3, 0), "K >= 1"),
])
def test_bad_weight(weight: torch.Tensor, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        ops.pack_linear_weight(weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_opcheck(dtype) -> None:
    x, w, b = _case(3, 16, 8, seed=3, bias=True, dtype=dtype)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.vllm_lite.pack_linear_weight.default, (w,), test_utils=utils)
    packed = ops.pack_linear_weight(w)
    torch.library.opcheck(torch.ops.vllm_lite.packed_linear.default, (x, packed, b, 8),
                          test_utils=utils)
