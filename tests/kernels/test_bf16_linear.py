"""torch.ops.vllm_lite.pack_bf16_weight / bf16_linear (CPU): every CPU build this machine
runs (the AVX512-BF16 kernel where selected, at::linear on the unpacked weight elsewhere)
against a float64 matmul on the same bf16 values, on fresh random inputs: row counts that
leave every row-tile tail, N that ends mid-panel and mid-vector, several panels per thread,
strided and NaN-surrounded rows, leading dims; argument checks; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .reference import assert_rounded_once_to_bf16

# Relative to the largest |output|: float32 accumulation in another order.
RTOL = 4e-6


def _case(m: int, k: int, n: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _reference(x, w, b):
    ref = x.double() @ w.double().t()
    return ref + b.double() if b is not None else ref


@pytest.fixture(params=ops.cpu_isas())
def isa(request: pytest.FixtureRequest):
    """Each CPU build in turn (bf16_linear follows the attention kernel's switch)."""
    before = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    yield request.param
    ops.set_cpu_isa(before)


# (rows, K, N): rows 1..9 and 15, 17, 31 leave each tail of the 8-row tile; N = 48 panels,
# N mid-panel (mid-vector or on a vector edge: 7, 16, 40, 100, 130, 1000) and many panels.
SHAPES = [(1, 2, 1), (1, 64, 48), (2, 64, 7), (3, 96, 16), (4, 576, 40), (5, 100, 100),
          (6, 32, 130), (7, 576, 960), (8, 64, 49), (9, 1536, 576), (15, 128, 1000),
          (17, 576, 96), (31, 576, 3072), (64, 200, 50), (300, 96, 144)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(isa: str, m: int, k: int, n: int, bias: bool) -> None:
    x, w, b = _case(m, k, n, seed=m * 1000 + n + k, bias=bias)
    packed = ops.pack_bf16_weight(w)
    assert packed.dtype == torch.bfloat16 and packed.shape[1:] == (k // 2, 48, 2)
    y = ops.bf16_linear(x, packed, b, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_rounded_once_to_bf16(y, _reference(x, w, b), RTOL)


def test_packed_layout() -> None:
    """[panel, j, c, e] = W[48 panel + c, 2 j + e], zeros past N."""
    _, w, _ = _case(1, 6, 50, seed=4, bias=False)
    packed = ops.pack_bf16_weight(w)
    assert packed.shape == (2, 3, 48, 2)
    for p in range(2):
        for j in range(3):
            for c in range(48):
                for e in range(2):
                    n = 48 * p + c
                    want = w[n, 2 * j + e] if n < 50 else torch.tensor(0.0, dtype=torch.bfloat16)
                    assert packed[p, j, c, e] == want


def test_leading_dims_and_strided_rows(isa: str) -> None:
    """x a column slice of a NaN-filled tensor (rows strided; the columns around it never
    read), and x [2, 3, K]."""
    x, w, b = _case(6, 40, 70, seed=5, bias=True)
    packed = ops.pack_bf16_weight(w)
    ref = _reference(x, w, b)
    wide = torch.full((6, 100), float("nan"), dtype=torch.bfloat16)
    wide[:, 30:70] = x
    assert_rounded_once_to_bf16(ops.bf16_linear(wide[:, 30:70], packed, b, 70), ref, RTOL)
    y3 = ops.bf16_linear(x.reshape(2, 3, 40), packed, b, 70)
    assert y3.shape == (2, 3, 70)
    assert_rounded_once_to_bf16(y3.reshape(6, 70), ref, RTOL)
    xt = torch.randn(40, 6).bfloat16().t()  # column-major rows: the op copies them
    assert_rounded_once_to_bf16(ops.bf16_linear(xt, packed, b, 70), _reference(xt, w, b), RTOL)


def test_empty_rows() -> None:
    _, w, _ = _case(1, 16, 8, seed=1, bias=False)
    assert ops.bf16_linear(torch.empty(0, 16, dtype=torch.bfloat16),
                           ops.pack_bf16_weight(w), None, 8).shape == (0, 8)


def test_linear_layer_uses_it_for_bf16() -> None:
    """models.llama.Linear on a bf16 weight: bf16_linear's packed copy where the kernel is
    selected (no oneDNN copy), results as the op's."""
    from vllm_lite.models.llama import Linear

    torch.manual_seed(6)
    lin = Linear(96, 100, bias=True).bfloat16()
    lin.prepare_for_cpu()
    if not ops.bf16_linear_kernel_selected():
        assert lin._bf16_packed is None
        pytest.skip(f"CPU build {ops.cpu_isa()}: no AVX512_BF16 kernel, Linear keeps oneDNN")
    assert lin._bf16_packed is not None and lin._packed is None
    x = torch.randn(5, 96).bfloat16()
    with torch.no_grad():
        y = lin(x)
    assert_rounded_once_to_bf16(y, _reference(x, lin.weight, lin.bias.float()), RTOL)


@pytest.mark.parametrize("what,args,match", [
    ("x dtype", lambda x, p, b, n: (x.float(), p, b, n), "x must be BFloat16"),
    ("scalar x", lambda x, p, b, n: (x[0, 0], p, b, n), "at least 1 dimension"),
    ("K", lambda x, p, b, n: (x[:, :-2], p, b, n), "last dimension"),
    ("packed dtype", lambda x, p, b, n: (x, p.float(), b, n), "packed_weight must be BFloat16"),
    ("packed dims", lambda x, p, b, n: (x, p[0], b, n), "packed_weight must be 4-D"),
    ("packed strided", lambda x, p, b, n: (x, torch.stack([p, p], -1)[..., 0], b, n), "packed_weight must be contiguous"),
    ("panel width", lambda x, p, b, n: (x, p[:, :, :16].contiguous(), b, n), "pack_bf16_weight's"),
    ("out_features", lambda x, p, b, n: (x, p, None, n + 48), "out_features"),
    ("out_features 0", lambda x, p, b, n: (x, p, None, 0), "out_features"),
    ("bias shape", lambda x, p, b, n: (x, p, b[:-1], n), "bias must be"),
    ("bias dtype", lambda x, p, b, n: (x, p, b.bfloat16(), n), "bias must be Float"),
])
def test_bad_arguments(what: str, args, match: str) -> None:
    x, w, b = _case(4, 16, 20, seed=2, bias=True)
    with pytest.raises(RuntimeError, match=match):
        ops.bf16_linear(*args(x, ops.pack_bf16_weight(w), b, 20))


@pytest.mark.parametrize("weight,match", [
    (torch.zeros(4, 5, dtype=torch.bfloat16), "even K"),
    (torch.zeros(4, 6), "weight must be BFloat16"),
    (torch.zeros(4, dtype=torch.bfloat16), "weight must be 2-D"),
    (torch.zeros(0, 6, dtype=torch.bfloat16), "N >= 1"),
])
def test_bad_weight(weight: torch.Tensor, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        ops.pack_bf16_weight(weight)


def test_opcheck() -> None:
    x, w, b = _case(3, 16, 8, seed=3, bias=True)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.vllm_lite.pack_bf16_weight.default, (w,), test_utils=utils)
    packed = ops.pack_bf16_weight(w)
    torch.library.opcheck(torch.ops.vllm_lite.bf16_linear.default, (x, packed, b, 8),
                          test_utils=utils)
