"""rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding against float64
references that round where the ops' contract (csrc/ops.h, HF Llama's order) rounds, on
every CPU ISA build and on CUDA; fresh random inputs, NaN-poisoned outputs, strided inputs,
sizes that leave partial vectors; bad arguments raise and change nothing; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

from .conftest import CUDA_SKIP

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Widths: 1, less than a vector, odd, the default model's, not a multiple of 16.
HIDDEN = (1, 7, 64, 576, 1000)


def _dev(backend) -> str:
    return backend.device


def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_T of a float64 tensor (nearest even, as torch's casts)."""
    return x.to(torch.float32).to(dtype).double()


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 math with the op's two roundings; x, w in their dtype."""
    xd = x.double()
    var = xd.pow(2).mean(-1, keepdim=True)
    y = rnd(xd * torch.rsqrt(var + eps), x.dtype)
    return rnd(w.double() * y, x.dtype)


def norm_limit(dtype: torch.dtype) -> float:
    """How far (in ulps of the dtype) a norm may be from the float64 reference: float32
    math (sum, rsqrt, two products) costs a few float32 ulps; in bf16 / fp16 that error
    only matters at a rounding boundary: y = round(x * inv) one step off, and w * y
    rounded again can then land two steps away when it crosses a power of two."""
    return 4.0 if dtype == torch.float32 else 2.0


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Within norm_limit, and in bf16 / fp16 equal to the reference almost everywhere (a
    float32 sum in another order moves a result only at a rounding boundary; a missing or
    extra rounding step would move about a fifth of them)."""
    got = out.cpu().double()
    assert ulps_apart(got, ref, dtype).max() <= norm_limit(dtype)
    if dtype != torch.float32:
        assert (got == ref).double().mean() >= 0.99


def ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|a - b| in units of dtype's spacing at b (both float64 values of dtype)."""
    eps = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    tiny = {torch.float32: 2.0**-126, torch.bfloat16: 2.0**-126, torch.float16: 2.0**-24}[dtype]
    return (a - b).abs() / (b.abs() * eps).clamp_min(tiny)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(backend, dtype: torch.dtype, hidden: int) -> None:
    dev = _dev(backend)
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(6, hidden, generator=g) * 3).to(dtype).to(dev)
    w = torch.randn(hidden, generator=g).to(dtype).to(dev)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, w, 1e-5, out=out)
    ref = ref_rms_norm(x.cpu(), w.cpu(), 1e-5)
    # The only freedom is the float32 sum's order: at most one step of the dtype apart.
    assert not out.isnan().any()
    assert_norm_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_and_batched_rows(backend, dtype: torch.dtype) -> None:
    """Rows of a wider tensor (one row stride) and leading dims that collapse; out is
    contiguous; the rest of the source is untouched."""
    dev = _dev(backend)
    base = torch.randn(5, 3, 100).to(dtype).to(dev)
    x = base[:, :, 10:74]  # [5, 3, 64], rows 100 apart
    w = torch.randn(64).to(dtype).to(dev)
    before = base.clone()
    out = ops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    assert_norm_close(out, ref_rms_norm(x.cpu(), w.cpu(), 1e-6), dtype)
    assert torch.equal(base, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm(backend, dtype: torch.dtype, hidden: int) -> None:
    dev = _dev(backend)
    g = torch.Generator().manual_seed(100 + hidden)
    x = torch.randn(9, hidden, generator=g).to(dtype).to(dev)
    r = (torch.randn(9, hidden, generator=g) * 4).to(dtype).to(dev)
    w = torch.randn(hidden, generator=g).to(dtype).to(dev)
    total = rnd(x.cpu().double() + r.cpu().double(), dtype)
    ref = ref_rms_norm(total.to(dtype), w.cpu(), 1e-6)
    xi, ri = x.clone(), r.clone()
    ops.fused_add_rms_norm(xi, ri, w, 1e-6)
    # The sum is one rounding of an exact float32 add: bit for bit.
    assert torch.equal(ri.cpu().double(), total)
    assert_norm_close(xi, ref, dtype)


def test_fused_add_rms_norm_variance_of_rounded_sum(backend) -> None:
    """The variance comes from the bf16-rounded residual (HF normalizes the stored sum):
    a row built so that the unrounded and rounded sums give different bf16 outputs."""
    dev = _dev(backend)
    hidden = 256
    g = torch.Generator().manual_seed(7)
    found = False
    for _ in range(20):
        x = torch.randn(64, hidden, generator=g).bfloat16()
        r = (torch.randn(64, hidden, generator=g) * 300).bfloat16()
        w = torch.ones(hidden).bfloat16()
        exact = x.double() + r.double()
        rounded = rnd(exact, torch.bfloat16)
        want = ref_rms_norm(rounded.bfloat16(), w, 1e-6)
        other = rnd(rounded * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-6),
                    torch.bfloat16)
        rows = (want != other).any(-1)
        if rows.any():
            found = True
            xi, ri = x.to(dev), r.to(dev)
            ops.fused_add_rms_norm(xi, ri, w.to(dev), 1e-6)
            got = xi.cpu().double()[rows]
            assert (ulps_apart(got, want[rows], torch.bfloat16) <= 1.0).all()
            break
    assert found, "no distinguishing row found (test inputs too tame)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (1, 5, 64, 1536, 1000))
def test_silu_and_mul(backend, dtype: torch.dtype, d: int) -> None:
    dev = _dev(backend)
    g = torch.Generator().manual_seed(200 + d)
    # Gates over a wide range: both exp branches, large |x| and tiny values.
    gate = torch.cat([torch.randn(7, d, generator=g) * 6,
                      torch.linspace(-100, 100, d)[None]]).to(dtype)
    up = torch.randn(8, d, generator=g).to(dtype)
    x = torch.cat([gate, up], dim=-1).to(dev)
    out = torch.full((8, d), float("nan"), dtype=dtype, device=dev)
    ops.silu_and_mul(x, out=out)
    gd = gate.double()
    act = rnd(gd / (1 + torch.exp(-gd)), dtype)
    ref = rnd(act * up.double(), dtype)
    assert not out.isnan().any()
    # float32 exp to a few ulp, then two roundings: round(silu) one step off at a boundary
    # can move the product two steps (see norm_limit); float32 a few ulps.
    limit = 8.0 if dtype == torch.float32 else 2.0
    assert ulps_apart(out.cpu().double(), ref, dtype).max() <= limit
    if dtype != torch.float32:  # and equal almost everywhere (see assert_norm_close)
        assert (out.cpu().double() == ref).double().mean() >= 0.99


def test_silu_and_mul_strided_input(backend) -> None:
    dev = _dev(backend)
    base = torch.randn(4, 50).to(dev)
    x = base[:, 5:45]  # [4, 40] = [gate 20 | up 20], rows 50 apart
    out = ops.silu_and_mul(x)
    ref = torch.nn.functional.silu(x[:, :20].double()) * x[:, 20:].double()
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-7)


def ref_rotate(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, head_size: int,
               neox: bool) -> torch.Tensor:
    """x [T, heads * head_size] in its dtype -> rotated float64 (the op's roundings)."""
    dt = x.dtype
    t = x.shape[0]
    rot = table.shape[1]
    half = rot // 2
    xd = x.double().view(t, -1, head_size).clone()
    row = table[pos].double()
    c = rnd(row[:, None, :half], dt)
    s = rnd(row[:, None, half:], dt)
    if neox:
        a, b = xd[..., :half], xd[..., half:rot]
    else:
        a, b = xd[..., 0:rot:2], xd[..., 1:rot:2]
    na = rnd(rnd(a * c, dt) - rnd(b * s, dt), dt)
    nb = rnd(rnd(b * c, dt) + rnd(a * s, dt), dt)
    if neox:
        xd[..., :half], xd[..., half:rot] = na, nb
    else:
        xd[..., 0:rot:2], xd[..., 1:rot:2] = na, nb
    return xd.view(t, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "gptj"))
@pytest.mark.parametrize("head_size,rot_dim", ((64, 64), (128, 128), (80, 80), (64, 32), (16, 6)))
@pytest.mark.parametrize("float_table", (True, False), ids=("f32table", "dtypetable"))
def test_rotary_embedding(backend, dtype, neox, head_size, rot_dim, float_table) -> None:
    dev = _dev(backend)
    g = torch.Generator().manual_seed(head_size * 7 + rot_dim)
    heads, kv_heads, tokens, max_pos = 4, 2, 11, 300
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).double() / rot_dim))
    freqs = torch.arange(max_pos).double()[:, None] * inv[None]
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float()
    table = table if float_table else table.to(dtype)
    # q and k are column slices of one fused qkv row (plus a gap) as in the model.
    width = (heads + 2 * kv_heads) * head_size + 3
    qkv = torch.randn(tokens, width, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    pos[0], pos[1] = 0, max_pos - 1
    q_ref = ref_rotate(qkv[:, :heads * head_size], pos, table, head_size, neox)
    k_ref = ref_rotate(qkv[:, heads * head_size:(heads + kv_heads) * head_size], pos, table,
                       head_size, neox)
    qkv_d = qkv.to(dev)
    before = qkv_d.clone()
    q = qkv_d[:, :heads * head_size]
    k = qkv_d[:, heads * head_size:(heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    ops.rotary_embedding(pos.to(dev), q, k, head_size, table.to(dev), neox)
    # Exact: the same float32 products and roundings.
    assert torch.equal(q.cpu().double(), q_ref)
    assert torch.equal(k.cpu().reshape(tokens, -1).double(), k_ref)
    rest = (heads + kv_heads) * head_size
    assert torch.equal(qkv_d[:, rest:], before[:, rest:])


def test_rotary_matches_model_float32_in_float64(backend) -> None:
    """float32 rotation against float64 math: within float32 rounding."""
    dev = _dev(backend)
    head, tokens = 64, 5
    inv = 1.0 / (500000 ** (torch.arange(0, head, 2).double() / head))
    pos = torch.tensor([0, 1, 1000, 4095, 17])
    freqs = torch.arange(4096).double()[:, None] * inv[None]
    table = torch.cat([freqs.cos(), freqs.sin()], -1)
    q = torch.randn(tokens, 3 * head)
    k = torch.randn(tokens, head)
    qd, kd = q.double().view(tokens, 3, head), k.double().view(tokens, 1, head)
    c, s = table[pos][:, None, :head // 2], table[pos][:, None, head // 2:]

    def rot(x):
        a, b = x[..., :head // 2], x[..., head // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    qo, ko = q.to(dev), k.to(dev)
    ops.rotary_embedding(pos.to(dev), qo, ko, head, table.float().to(dev), True)
    torch.testing.assert_close(qo.cpu().double().view(tokens, 3, head), rot(qd), atol=2e-6, rtol=0)
    torch.testing.assert_close(ko.cpu().double().view(tokens, 1, head), rot(kd), atol=2e-6, rtol=0)


def test_empty_inputs(backend) -> None:
    dev = _dev(backend)
    w = torch.randn(8, device=dev)
    assert ops.rms_norm(torch.empty(0, 8, device=dev), w, 1e-6).shape == (0, 8)
    ops.fused_add_rms_norm(torch.empty(0, 8, device=dev), torch.empty(0, 8, device=dev), w, 1e-6)
    assert ops.silu_and_mul(torch.empty(0, 8, device=dev)).shape == (0, 4)
    table = torch.randn(4, 8, device=dev)
    ops.rotary_embedding(torch.empty(0, dtype=torch.long, device=dev),
                         torch.empty(0, 16, device=dev), torch.empty(0, 8, device=dev), 8, table)


# ---- bad arguments: a RuntimeError naming the argument, nothing written ----------------

def _norm_case(dev):
    x = torch.randn(4, 8, device=dev)
    return x, torch.randn(8, device=dev), torch.full_like(x, float("nan"))


BAD_NORM = [
    ("weight", lambda x, w, o: (o, x, w[:7], 1e-6), "weight must be \\[hidden\\]"),
    ("weight dtype", lambda x, w, o: (o, x, w.double(), 1e-6), "weight is"),
    ("out shape", lambda x, w, o: (o[:3], x, w, 1e-6), "out must have input's shape"),
    ("out dtype", lambda x, w, o: (o.half(), x, w, 1e-6), "out is"),
    ("out strided", lambda x, w, o: (torch.empty(8, 4, device=o.device).t(), x, w, 1e-6),
     "out must be contiguous"),
    ("epsilon", lambda x, w, o: (o, x, w, -1.0), "epsilon"),
    ("epsilon nan", lambda x, w, o: (o, x, w, float("nan")), "epsilon"),
    ("input dtype", lambda x, w, o: (o.double(), x.double(), w.double(), 1e-6),
     "input must be float32, float16 or bfloat16"),
    ("input last dim", lambda x, w, o: (torch.empty(8, 4, device=o.device), x.t(),
                                        torch.ones(4, device=o.device), 1e-6),
     "input's last dimension must be contiguous"),
    ("input rows", lambda x, w, o: (torch.empty(2, 2, 2, 2, device=o.device),
                                    torch.randn(2, 4, 2, 2, device=o.device)[:, ::2],
                                    torch.ones(2, device=o.device), 1e-6),
     "collapse into rows"),
]


@pytest.mark.parametrize("name,make,message", BAD_NORM, ids=[b[0] for b in BAD_NORM])
def test_rms_norm_bad_arguments(device, name, make, message) -> None:
    if device == "cuda" and CUDA_SKIP:
        pytest.skip(CUDA_SKIP)
    x, w, o = _norm_case(device)
    args = make(x, w, o)
    out = args[0]
    before = out.clone()
    with pytest.raises(RuntimeError, match=f"rms_norm: .*{message}"):
        torch.ops.vllm_lite.rms_norm(*args)
    assert torch.equal(out.isnan(), before.isnan()) and torch.equal(out.nan_to_num(), before.nan_to_num())


def test_fused_add_rms_norm_bad_arguments(device) -> None:
    x, w, _ = _norm_case(device)
    r = torch.randn(4, 8, device=device)
    cases = [
        ((x, r[:3], w, 1e-6), "residual must have input's shape"),
        ((x, r.half(), w, 1e-6), "residual is"),
        ((x, torch.randn(8, 4, device=device).t(), w, 1e-6), "residual must be contiguous"),
        ((torch.randn(8, 4, device=device).t(), r, w, 1e-6), "input must be contiguous"),
        ((x, r, w, float("inf")), "epsilon"),
    ]
    for args, message in cases:
        snapshot = [a.clone() for a in args[:2]]
        with pytest.raises(RuntimeError, match=f"fused_add_rms_norm: .*{message}"):
            torch.ops.vllm_lite.fused_add_rms_norm(*args)
        assert all(torch.equal(a, b) for a, b in zip(args[:2], snapshot))


def test_silu_and_mul_bad_arguments(device) -> None:
    x = torch.randn(3, 8, device=device)
    cases = [
        ((torch.empty(3, 4, device=device), torch.randn(3, 7, device=device)), "must be even"),
        ((torch.empty(3, 8, device=device), x), "out must be \\[3, 4\\]"),
        ((torch.empty(3, 4, dtype=torch.half, device=device), x), "out is"),
        ((torch.empty(4, 3, device=device).t(), x), "out must be contiguous"),
    ]
    for (out, inp), message in cases:
        out.fill_(float("nan"))
        with pytest.raises(RuntimeError, match=f"silu_and_mul: .*{message}"):
            torch.ops.vllm_lite.silu_and_mul(out, inp)
        assert out.isnan().all()


def test_rotary_bad_arguments(device) -> None:
    table = torch.randn(16, 8, device=device)
    pos = torch.tensor([0, 3, 15], device=device)
    q, k = torch.randn(3, 16, device=device), torch.randn(3, 8, device=device)
    cases = [
        ((pos.int(), q, k, 8, table, True), "positions must be"),
        ((pos[:2], q, k, 8, table, True), "query has 3 tokens but positions has 2"),
        ((pos, q, k, 6, table, True), "rot_dim 8.*head_size \\(6\\)"),
        ((pos, q[:, :12], k, 8, table, True), "multiple of head_size"),
        ((pos, q, k.double(), 8, table, True), "key is"),
        ((pos, q, k, 8, table.double(), True), "cos_sin_cache must be float32 or the query dtype"),
        ((pos, q, k, 8, table[:, :7], True), "cos_sin_cache must be contiguous|rot_dim 7"),
        ((pos, q, k, 0, table, True), "head_size must be positive"),
        ((pos, q, q, 8, table, True), "must not be the same memory"),
        ((pos, torch.randn(3, 2, 16, device=device)[:, :, :8], k, 8, table, True),
         "heads must be contiguous"),
    ]
    if device == "cpu":  # CUDA checks values only with VLLM_LITE_CHECK_VALUES=1
        cases.append(((torch.tensor([0, 16, 1], device=device), q, k, 8, table, True),
                      "positions\\[1\\] = 16 is outside the table's 16 positions"))
        cases.append(((torch.tensor([0, -1, 1], device=device), q, k, 8, table, True),
                      "positions\\[1\\] = -1"))
    for args, message in cases:
        snapshot = (args[1].clone(), args[2].clone())
        with pytest.raises(RuntimeError, match=f"rotary_embedding: .*({message})"):
            torch.ops.vllm_lite.rotary_embedding(*args)
        assert torch.equal(args[1], snapshot[0]) and torch.equal(args[2], snapshot[1])


ELEMENTWISE_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")


def _opcheck_args(op: str, dev: str):
    if op == "rms_norm":
        x = torch.randn(3, 8, device=dev)
        return (torch.empty_like(x), x, torch.randn(8, device=dev), 1e-6)
    if op == "fused_add_rms_norm":
        return (torch.randn(3, 8, device=dev), torch.randn(3, 8, device=dev),
                torch.randn(8, device=dev), 1e-6)
    if op == "silu_and_mul":
        return (torch.empty(3, 4, device=dev), torch.randn(3, 8, device=dev))
    return (torch.tensor([0, 2, 5], device=dev), torch.randn(3, 16, device=dev),
            torch.randn(3, 8, device=dev), 8, torch.randn(6, 8, device=dev), True)


@pytest.mark.parametrize("op", ELEMENTWISE_OPS)
def test_opcheck(device, op) -> None:
    """Schema annotations match what the kernel mutates; the fake impl traces."""
    if device == "cuda" and CUDA_SKIP:
        pytest.skip(CUDA_SKIP)
    torch.library.opcheck(getattr(torch.ops.vllm_lite, op).default, _opcheck_args(op, device),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))


@pytest.mark.parametrize("op", ELEMENTWISE_OPS)
def test_kernels_registered(op) -> None:
    from vllm_lite import _build_info

    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_lite::{op}", "CPU")
    if _build_info.WITH_CUDA:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_lite::{op}", "CUDA")
