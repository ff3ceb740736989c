"""torch.ops.vllm_lite.pack_linear_weight / packed_linear (CPU), float32 and bfloat16: every
CPU build this machine runs (the AVX-512 / AVX512-BF16 / AVX2 kernels where selected,
at::linear on the unpacked weight elsewhere) against a float64 matmul on the same values,
on fresh random inputs: row counts that leave every row-tile tail, N that ends mid-panel
and mid-vector, several panels per thread, strided and NaN-surrounded rows, NaN-poisoned
outputs, leading dims; argument checks; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .conftest import nan_filled_buffers
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


# (rows, K, N): rows 1..9 and 15, 17, 31 leave each tail of the 8-row tile (and of the AMX
# build's 16-row tiles, which start at 3 rows; 16, 48: whole tiles); K past the AMX tiles'
# 32 (34, 100, 200: 2-8 k left to the vector epilogue; 2, 16: no tile at all); N = 48
# panels, N mid-panel (mid-vector or on a vector edge: 7, 16, 40, 100, 130, 1000) and many
# panels.
SHAPES = [(1, 2, 1), (1, 64, 48), (2, 64, 7), (3, 96, 16), (4, 576, 40), (5, 100, 100),
          (6, 32, 130), (7, 576, 960), (8, 64, 49), (9, 1536, 576), (15, 128, 1000),
          (16, 34, 130), (17, 576, 96), (20, 16, 40), (31, 576, 3072), (48, 2, 7),
          (48, 576, 1000), (64, 200, 50), (300, 96, 144),
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_every_output_written(isa: str, dtype) -> None:
    """The outputs' memory starts as NaN (nan_filled_buffers), so a row or column that a
    tile leaves unwritten shows as NaN: row counts ending mid-tile, N and I mid-vector."""
    with nan_filled_buffers():
        assert torch.empty(5, 7, dtype=dtype).isnan().all(), "nan_filled_buffers no longer poisons"
        for m, k, n in [(1, 64, 1001), (3, 32, 301), (7, 96, 250), (17, 64, 202), (64, 40, 90)]:
            x, w, b = _case(m, k, n, seed=m + n, bias=True, dtype=dtype)
            packed = ops.pack_linear_weight(w)
            i = n // 2
            gated, gb = _pack_gated(w[: 2 * i], b[: 2 * i])
            y = ops.packed_linear(x, packed, b, n)
            assert not y.isnan().any(), f"rows {m}, N {n}: an output left unwritten"
            _check(y, _reference(x, w, b))
            y = ops.packed_gated_linear(x, gated, gb, i)
            assert not y.isnan().any(), f"rows {m}, I {i}: a gated output left unwritten"


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
    copy), results as the op's."""
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
    _check(y, _reference(x, lin.weight.detach(), lin.bias.detach().float()))


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


# ---- packed_gated_linear: silu(gate) * up of a [gate | up] weight in one GEMM ----------

def _gated_reference(x, w, b):
    """float64 silu(x gate^T + b_gate) * (x up^T + b_up)."""
    ref = _reference(x, w, b)
    i = w.shape[0] // 2
    return torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]


def _pack_gated(w, b):
    return (ops.pack_linear_weight(ops.gated_panel_rows(w)),
            ops.gated_panel_rows(b) if b is not None else None)


# (rows, K, I): I = 24 a panel's outputs, I mid-panel (7, 40: the second vector's 8
# lanes; 16 on its edge, 100), the default model's 576 x 1536; rows as SHAPES.
GATED_SHAPES = [(1, 2, 1), (1, 64, 24), (2, 64, 7), (3, 96, 16), (4, 576, 40),
                (5, 100, 100), (8, 34, 17), (9, 576, 1536), (16, 34, 40), (17, 576, 96),
                (31, 64, 300),
                (300, 96, 72), (700, 1536, 25)]


@pytest.mark.parametrize("m,k,i", GATED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gated_matches_float64_and_the_unfused_ops(isa: str, m: int, k: int, i: int, bias: bool,
                                                   dtype) -> None:
    """Within rounding of the float64 reference, and where the kernel runs the same bits
    as packed_linear then silu_and_mul (what the layer ran before; it rounds the projection
    first). Elsewhere both go through at::linear, on differently shaped weights."""
    x, w, b = _case(m, k, 2 * i, seed=m * 1000 + i + k + 7, bias=bias, dtype=dtype)
    packed, gb = _pack_gated(w, b)
    y = ops.packed_gated_linear(x, packed, gb, i)
    assert y.shape == (m, i) and y.dtype == dtype
    ref = _gated_reference(x, w, b)
    # Two roundings of the projection before the product in bf16 (the unfused ops' own).
    tol = (2e-2 if dtype == torch.bfloat16 else 1e-5) * float(ref.abs().max()) + 1e-6
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=tol)
    unfused = ops.silu_and_mul(ops.packed_linear(x, ops.pack_linear_weight(w), b, 2 * i))
    if ops.packed_linear_kernel_selected(dtype):
        assert torch.equal(y, unfused)


@pytest.mark.parametrize("k", [4, 64])  # 64: through the AMX build's tiles too
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gated_extreme_values(isa: str, dtype, k: int) -> None:
    """Gates far negative (silu underflows gradually), large, NaN and inf: the unfused ops'
    values, NaN where they give NaN (one nonzero product per output: exact on any path)."""
    i = 30
    w = torch.zeros(2 * i, k, dtype=dtype)
    w[:i, 0] = torch.tensor([-200., -100., -88., -87., -20., -1e-3, 0., 1e-3, 3., 90., 1e4,
                             -1e4, 5., -5., 0.5, -0.5, 1e30, -1e30, 7., -7., 1., -1., 2.,
                             -2., 10., -10., 60., -60., 0.25, -0.25]).to(dtype)
    w[i:, 1] = torch.linspace(-3, 3, i).to(dtype)
    x = torch.zeros(4, k)
    x[:, :2] = torch.tensor([[1., 1.], [float("nan"), 1.], [float("inf"), 1.], [1., float("-inf")]])
    x = x.to(dtype)
    packed, _ = _pack_gated(w, None)
    y = ops.packed_gated_linear(x, packed, None, i)
    unfused = ops.silu_and_mul(ops.packed_linear(x, ops.pack_linear_weight(w), None, 2 * i))
    torch.testing.assert_close(y, unfused, rtol=0, atol=0, equal_nan=True)


def test_gated_panel_rows_order() -> None:
    """Per panel: 24 gate rows then the same outputs' up rows, zero rows past I."""
    i = 30
    w = torch.arange(2 * i * 3, dtype=torch.float32).reshape(2 * i, 3) + 1
    rows = ops.gated_panel_rows(w)
    assert rows.shape == (96, 3)
    for p in range(2):
        for c in range(24):
            j = 24 * p + c
            gate, up = rows[48 * p + c], rows[48 * p + 24 + c]
            if j < i:
                assert torch.equal(gate, w[j]) and torch.equal(up, w[i + j])
            else:
                assert not gate.any() and not up.any()
    assert torch.equal(ops.gated_panel_rows(w[:, 0]), rows[:, 0])  # a bias the same way
    with pytest.raises(ValueError, match="t must be"):
        ops.gated_panel_rows(w[:-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gated_linear_layer(dtype) -> None:
    """models.llama.Linear(gated=True) packs in gated order where the kernel is selected and
    forward(x, silu_and_mul=True) is the op; plain forward still the projection."""
    from vllm_lite.models.llama import Linear

    torch.manual_seed(8)
    lin = Linear(64, 80, bias=True, gated=True).to(dtype)
    lin.prepare_for_cpu()
    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        act, plain = lin(x, silu_and_mul=True), lin(x)
    w, b = lin.weight.detach(), lin.bias.detach().float()
    ref = _reference(x, w, b)
    torch.testing.assert_close(plain.double(), ref, rtol=0, atol=2e-2 * float(ref.abs().max()))
    gated_ref = _gated_reference(x, w, b)
    torch.testing.assert_close(act.double(), gated_ref, rtol=0,
                               atol=2e-2 * float(gated_ref.abs().max()))
    assert lin.gated_packed == ops.packed_linear_kernel_selected(dtype)
    if lin.gated_packed:  # the op on the gated copy: the unfused packed ops' bits
        unfused = ops.silu_and_mul(ops.packed_linear(x, ops.pack_linear_weight(w), b, 80))
        assert torch.equal(act, unfused)
    with pytest.raises(ValueError, match="even out_features"):
        Linear(64, 81, gated=True)


@pytest.mark.parametrize("what,args,match", [
    ("I", lambda x, p, b, i: (x, p, b, i + 24), "intermediate_size"),
    ("I 0", lambda x, p, b, i: (x, p, None, 0), "intermediate_size"),
    ("bias shape", lambda x, p, b, i: (x, p, b[:-1], i), r"bias must be \[panels"),
    ("bias unpermuted", lambda x, p, b, i: (x, p, b[:2 * i], i), r"bias must be \[panels"),
    ("K", lambda x, p, b, i: (x[:, :-2], p, b, i), "packed_gated_linear: x's last dimension"),
    ("packed dtype", lambda x, p, b, i: (x, p.float(), b, i), "packed_weight must be BFloat16"),
])
def test_gated_bad_arguments(what: str, args, match: str) -> None:
    x, w, b = _case(4, 16, 2 * 20, seed=2, bias=True, dtype=torch.bfloat16)
    packed, gb = _pack_gated(w, b)
    with pytest.raises(RuntimeError, match=match):
        ops.packed_gated_linear(*args(x, packed, gb, 20))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gated_opcheck(dtype) -> None:
    x, w, b = _case(3, 16, 2 * 10, seed=3, bias=True, dtype=dtype)
    packed, gb = _pack_gated(w, b)
    torch.library.opcheck(torch.ops.vllm_lite.packed_gated_linear.default, (x, packed, gb, 10),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
