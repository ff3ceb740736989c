"""rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding of csrc/cuda, run on the
CPU by the SIMT emulator, against float64 references written here that round where the
ops' contract (csrc/ops.h, HF Llama's order) rounds: round_T(v) = v -> float32 -> T, each
step spelled out with torch casts.

Exact (bit for bit): fused_add_rms_norm's residual (one rounding of an exact float32 add)
and rotary_embedding (float32 products of T values, rounded as the formula says).
Tolerances elsewhere: the norms' float32 sum of squares may run in any order, and silu's exp
is float32 math; in bf16 / fp16 that moves a result only at a rounding boundary (<= 1 step
of the dtype, and equal almost everywhere), in float32 a few ulps.

Inputs are fresh random tensors; outputs start as NaN (every element must be written);
input storages, gaps between strided rows and the columns of a fused qkv row outside q / k
must be untouched. Sizes cover the 16-byte vector paths (hidden a multiple of a chunk,
aligned) and the element-wise ones (odd sizes, rows strided by an odd count, buffers one
element off a 16-byte boundary). Rotary positions outside the table must not read outside it
(AddressSanitizer: the table is allocated to its exact size). Each case runs under every
schedule seed of harness.seeds() (the first
by default, the others with --full-grid); each (case, seed) is a test.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from ops.reference import assert_bitwise_equal, dtype_name  # tests/ is on sys.path
from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
CODE = {F32: "f32", F16: "f16", BF16: "bf16"}
HIDDEN = (1, 7, 64, 576, 1000, 4096)


def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_T of float64 values: to float32 (the kernels' math) then to T, nearest even."""
    return x.to(torch.float32).to(dtype).double()


def two_step_candidates(y: torch.Tensor, m: torch.Tensor, dt: torch.dtype):
    """round_T(m * y) for y (float64 values of dt, already rounded to dt) and for y one step
    of dt below / above: (reference, down, up). The kernels compute y's unrounded value
    within a few float32 ulps (a sum in another order, rsqrt; exp), which moves y only
    where it lies at a rounding boundary of dt, and then by one step; m * y then rounds to
    the reference or to one of the others (two steps of dt from the reference when m * y
    crosses a power of 2, so a plain one-step tolerance would be wrong)."""
    yt = y.to(dt)
    up = torch.nextafter(yt, torch.full_like(yt, float("inf"))).double()
    down = torch.nextafter(yt, torch.full_like(yt, float("-inf"))).double()
    md = m.double()
    return rnd(md * y, dt), rnd(md * down, dt), rnd(md * up, dt)


def norm_candidates(x: torch.Tensor, w: torch.Tensor, eps: float):
    """rms_norm of x [rows, hidden] with weight w (in their dtype): two_step_candidates of
    y = round_T(x * rsqrt(mean(x^2) + eps)), computed in float64."""
    xd = x.double()
    var = xd.pow(2).mean(-1, keepdim=True)
    return two_step_candidates(rnd(xd * torch.rsqrt(var + eps), x.dtype), w, x.dtype)


def assert_two_step_close(got: torch.Tensor, cands, dtype: torch.dtype, f32_limit: float,
                          what: str) -> None:
    """float32: within f32_limit ulps of the reference; bf16 / fp16: every element is one of
    the candidates (two_step_candidates), and at least 99% are the reference itself (a
    missing or extra rounding would move about a fifth). NaN / inf where the reference has
    them."""
    want, down, up = cands
    got = got.double()
    if dtype == F32:
        assert_close_ulps(got, want, dtype, f32_limit, what)
        return
    ok = (got == want) | (got == down) | (got == up) | (got.isnan() & want.isnan())
    # bf16 reaches float32's subnormal range, which the GPU flushes to zero (--use_fast_math):
    # there only an absolute tolerance of one float32 normal step.
    ok |= (want.abs() < 2.0**-126) & ((got - want).abs() <= 2.0**-126)
    if not ok.all():
        i = int((~ok).nonzero()[0][0]) if got.dim() == 1 else tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int((~ok).sum())} elements are neither the reference nor "
                             f"a one-step neighbour of its y; first at {i}: got {got[i].item()!r},"
                             f" want {want[i].item()!r}")
    exact = (got == want).double().mean().item()
    assert exact >= 0.99, f"{what}: only {exact:.2%} equal to the reference"


def silu_candidates(x: torch.Tensor):
    """silu_and_mul of x [rows, 2d] (its dtype): two_step_candidates of
    a = round_T(silu(gate)) times up, silu in float64."""
    d = x.shape[-1] // 2
    g, u = x[..., :d].double(), x[..., d:].double()
    return two_step_candidates(rnd(g / (1 + torch.exp(-g)), x.dtype), u, x.dtype)


def ref_rotate(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, head_size: int,
               neox: bool) -> torch.Tensor:
    """x [tokens, heads * head_size] in its dtype -> rotated float64 values of the dtype."""
    dt, t, rot = x.dtype, x.shape[0], table.shape[1]
    half = rot // 2
    xd = x.double().reshape(t, -1, head_size).clone()
    row = table[pos].double()
    c, s = rnd(row[:, None, :half], dt), rnd(row[:, None, half:], dt)
    if neox:
        a, b = xd[..., :half].clone(), xd[..., half:rot].clone()
    else:
        a, b = xd[..., 0:rot:2].clone(), xd[..., 1:rot:2].clone()
    na = rnd(rnd(a * c, dt) - rnd(b * s, dt), dt)
    nb = rnd(rnd(b * c, dt) + rnd(a * s, dt), dt)
    if neox:
        xd[..., :half], xd[..., half:rot] = na, nb
    else:
        xd[..., 0:rot:2], xd[..., 1:rot:2] = na, nb
    return xd.reshape(t, -1)


EPS = {F32: 2.0**-23, BF16: 2.0**-7, F16: 2.0**-10}
TINY = {F32: 2.0**-126, BF16: 2.0**-126, F16: 2.0**-24}


def ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|a - b| in steps of dtype at b (float64 values of dtype); subnormal results count
    against the smallest normal step (the GPU flushes float32 subnormals)."""
    return (a - b).abs() / (b.abs() * EPS[dtype]).clamp_min(TINY[dtype])


def assert_close_ulps(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                      f32_limit: float, what: str) -> None:
    """Equal NaN / inf positions; elsewhere within 1 step of bf16 / fp16 (and equal in at
    least 99% of the elements: a missing or extra rounding would move about a fifth), or
    within f32_limit float32 ulps."""
    got, ref = got.double(), ref.double()
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN positions differ"
    fin = ~ref.isnan()
    inf = fin & ref.isinf()
    assert torch.equal(got[inf], ref[inf]), f"{what}: infinities differ"
    m = fin & ~inf
    g, r = got[m], ref[m]
    if g.numel() == 0:
        return
    u = ulps_apart(g, r, dtype)
    limit = f32_limit if dtype == F32 else 1.0
    worst = int(u.argmax())
    assert u.max() <= limit, (f"{what}: {u.max().item():.3g} ulps apart (limit {limit}) at "
                              f"{worst}: got {g[worst].item()!r}, want {r[worst].item()!r}")
    if dtype != F32:
        exact = (g == r).double().mean().item()
        assert exact >= 0.99, f"{what}: only {exact:.2%} equal to the reference"


def _gen(case_id: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case_id.encode()))


# ---------------------------------------------------------------------------------------
# rms_norm


@dataclass(frozen=True)
class NormCase:
    id: str
    dtype: torch.dtype
    hidden: int
    layout: str  # contiguous | strided (vector-friendly) | strided_odd | misaligned


def _norm_cases() -> list[NormCase]:
    out = []
    for dt in DTYPES:
        for h in HIDDEN:
            for lay in ("contiguous", "strided"):
                out.append(NormCase(f"rms-{dtype_name(dt)}-h{h}-{lay}", dt, h, lay))
        for h, lay in ((64, "strided_odd"), (4096, "strided_odd"), (576, "misaligned"),
                       (1000, "misaligned")):
            out.append(NormCase(f"rms-{dtype_name(dt)}-h{h}-{lay}", dt, h, lay))
    return out


NORM_CASES = _norm_cases()


def _prepare_norm(c: NormCase, root):
    g = _gen(c.id)
    h = c.hidden
    if c.layout == "contiguous":
        base = (torch.randn(5, h, generator=g) * 3).to(c.dtype)
        x = base
    elif c.layout == "strided":  # [2, 3, h] rows h + 16 apart, 8 elements in: chunk-aligned
        base = (torch.randn(2, 3, h + 16, generator=g) * 3).to(c.dtype)
        x = base[:, :, 8:8 + h]
    elif c.layout == "strided_odd":  # rows h + 3 apart, one element in
        base = (torch.randn(4, h + 3, generator=g) * 3).to(c.dtype)
        x = base[:, 1:1 + h]
    else:  # misaligned: contiguous, but every buffer one element past a 16-byte boundary
        base = (torch.randn(3, h, generator=g) * 3).to(c.dtype)
        x = base
    w = torch.randn(h, generator=g).to(c.dtype)
    x2 = x.reshape(-1, h)
    rows = x2.shape[0]
    eps = 1e-5 if c.hidden % 2 else 1e-6
    want = norm_candidates(x2, w, eps)
    out = torch.full((rows, h), float("nan"), dtype=c.dtype)
    storage, off = harness.storage_of(x)
    shift = x.element_size() if c.layout == "misaligned" else 0
    row_stride = x.stride(-2) if rows > 1 else h
    cd = case_dir(root, c.id)
    cd.set(op="rms_norm", dtype=CODE[c.dtype], rows=rows, hidden=h, row_stride=row_stride,
           epsilon=eps, in_offset=off)
    cd.buf("input_storage", storage, offset=shift, out=True)
    cd.buf("weight", w, offset=shift, out=True)
    cd.buf("out", out, offset=shift, out=True)
    cd.write()
    return cd, (storage.clone(), w, out, want)


# ---------------------------------------------------------------------------------------
# fused_add_rms_norm


@dataclass(frozen=True)
class FusedCase:
    id: str
    dtype: torch.dtype
    hidden: int
    layout: str  # contiguous | misaligned | big_residual (the variance must be the rounded sum's)


def _fused_cases() -> list[FusedCase]:
    out = []
    for dt in DTYPES:
        for h in HIDDEN:
            out.append(FusedCase(f"fused-{dtype_name(dt)}-h{h}", dt, h, "contiguous"))
        out.append(FusedCase(f"fused-{dtype_name(dt)}-h576-misaligned", dt, 576, "misaligned"))
    for dt in (BF16, F16):
        out.append(FusedCase(f"fused-{dtype_name(dt)}-h256-big_residual", dt, 256, "big_residual"))
    return out


FUSED_CASES = _fused_cases()


def _prepare_fused(c: FusedCase, root):
    g = _gen(c.id)
    h = c.hidden
    rows = 64 if c.layout == "big_residual" else 9
    if c.layout == "big_residual":
        # x is 0.2-0.45 of a step of the residual, with its sign: x + r rounds back to r,
        # always toward zero, so the rounded sum's variance is systematically below the
        # unrounded one's (by ~0.6 of a step of the dtype in y): about a third of the
        # outputs tell which variance a kernel used.
        r = (torch.randn(rows, h, generator=g) * 300).to(c.dtype)
        mag = r.abs()
        step = torch.nextafter(mag, torch.full_like(mag, float("inf"))).double() - mag.double()
        frac = 0.2 + 0.25 * torch.rand(rows, h, generator=g, dtype=torch.float64)
        x = (r.double().sign() * step * frac).to(c.dtype)
        w = torch.ones(h).to(c.dtype)
    else:
        x = torch.randn(rows, h, generator=g).to(c.dtype)
        r = (torch.randn(rows, h, generator=g) * 4).to(c.dtype)
        w = torch.randn(h, generator=g).to(c.dtype)
    total = rnd(x.double() + r.double(), c.dtype)
    cands = norm_candidates(total.to(c.dtype), w, 1e-6)
    want = cands[0]
    # What a kernel normalizing the unrounded sum would give (to check the case can tell).
    exact = x.double() + r.double()
    other = rnd(w.double() * rnd(total * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-6),
                                 c.dtype), c.dtype)
    shift = x.element_size() if c.layout == "misaligned" else 0
    cd = case_dir(root, c.id)
    cd.set(op="fused_add_rms_norm", dtype=CODE[c.dtype], rows=rows, hidden=h, epsilon=1e-6)
    cd.buf("input", x, offset=shift, out=True)
    cd.buf("residual", r, offset=shift, out=True)
    cd.buf("weight", w, offset=shift, out=True)
    cd.write()
    return cd, (x, r, w, total, cands, other)


# ---------------------------------------------------------------------------------------
# silu_and_mul

# Gates at the edges of silu's float32 computation: zeros, tiny values, both signs around
# exp's overflow / underflow (|x| ~ 87-104, where x * exp(x) turns subnormal), far beyond
# it, infinities and NaN.
SPECIAL_GATES = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5, -0.5, 20.0, -20.0, 30.0, -30.0,
                 60.0, -60.0, 86.9, -86.9, 87.5, -87.5, 88.8, -88.8, 90.0, -90.0, 95.0, -95.0,
                 103.0, -103.0, 120.0, -120.0, 173.0, -173.0, 175.0, -175.0, 1e4, -1e4,
                 float("inf"), float("-inf"), float("nan")]


@dataclass(frozen=True)
class SiluCase:
    id: str
    dtype: torch.dtype
    d: int
    layout: str  # contiguous | strided (chunk-aligned) | strided_odd | misaligned


def _silu_cases() -> list[SiluCase]:
    out = []
    for dt in DTYPES:
        for d in (1, 5, 64, 1000, 1536, 4096):
            out.append(SiluCase(f"silu-{dtype_name(dt)}-d{d}", dt, d, "contiguous"))
        out.append(SiluCase(f"silu-{dtype_name(dt)}-d64-strided", dt, 64, "strided"))
        out.append(SiluCase(f"silu-{dtype_name(dt)}-d40-strided_odd", dt, 40, "strided_odd"))
        out.append(SiluCase(f"silu-{dtype_name(dt)}-d1536-misaligned", dt, 1536, "misaligned"))
    return out


SILU_CASES = _silu_cases()


def _prepare_silu(c: SiluCase, root):
    g = _gen(c.id)
    d = c.d
    rows = 9
    special = torch.tensor(SPECIAL_GATES).repeat(d // len(SPECIAL_GATES) + 1)[:d]
    gate = torch.cat([torch.randn(rows - 2, d, generator=g) * 6,
                      torch.linspace(-100, 100, d)[None], special[None]])
    up = torch.randn(rows, d, generator=g)
    full = torch.cat([gate, up], -1).to(c.dtype)
    if c.layout == "strided":  # rows 2d + 16 apart, 8 elements in
        base = torch.randn(rows, 2 * d + 16, generator=g).to(c.dtype)
        base[:, 8:8 + 2 * d] = full
        x = base[:, 8:8 + 2 * d]
    elif c.layout == "strided_odd":
        base = torch.randn(rows, 2 * d + 3, generator=g).to(c.dtype)
        base[:, 1:1 + 2 * d] = full
        x = base[:, 1:1 + 2 * d]
    else:
        x = full
    want = silu_candidates(x)
    out = torch.full((rows, d), float("nan"), dtype=c.dtype)
    storage, off = harness.storage_of(x)
    shift = x.element_size() if c.layout == "misaligned" else 0
    cd = case_dir(root, c.id)
    cd.set(op="silu_and_mul", dtype=CODE[c.dtype], rows=rows, hidden=d,
           row_stride=x.stride(0), in_offset=off)
    cd.buf("input_storage", storage, offset=shift, out=True)
    cd.buf("out", out, offset=shift, out=True)
    cd.write()
    return cd, (storage.clone(), out, want)


# ---------------------------------------------------------------------------------------
# rotary_embedding


@dataclass(frozen=True)
class RotaryCase:
    id: str
    dtype: torch.dtype
    neox: bool
    head_size: int
    rot_dim: int
    table: str  # f32 | same
    heads: int
    kv_heads: int
    bad_positions: bool = False


def _rotary_cases() -> list[RotaryCase]:
    out = []
    shapes = ((64, 64, 4, 2), (128, 128, 8, 1), (80, 80, 4, 2), (128, 64, 2, 2), (80, 32, 3, 1))
    for dt in DTYPES:
        for neox in (True, False):
            for hs, rot, h, kvh in shapes:
                for table in (("f32",) if dt == F32 else ("f32", "same")):
                    out.append(RotaryCase(
                        f"rotary-{dtype_name(dt)}-{'neox' if neox else 'gptj'}-hs{hs}-rot{rot}"
                        f"-h{h}k{kvh}-{table}", dt, neox, hs, rot, table, h, kvh))
        out.append(RotaryCase(f"rotary-{dtype_name(dt)}-neox-hs128-rot64-badpos", dt, True, 128,
                              64, "f32", 4, 2, bad_positions=True))
    return out


ROTARY_CASES = _rotary_cases()
MAX_POS = 300


def _prepare_rotary(c: RotaryCase, root):
    g = _gen(c.id)
    hs, rot, h, kvh = c.head_size, c.rot_dim, c.heads, c.kv_heads
    tokens = 11
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).double() / rot))
    freqs = torch.arange(MAX_POS).double()[:, None] * inv[None]
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float()
    if c.table == "same":
        table = table.to(c.dtype)
    # q and k are column slices of one fused qkv row (v and 3 more columns after them), so
    # the token stride is odd and only q / k may change.
    width = (h + 2 * kvh) * hs + 3
    qkv = torch.randn(tokens, width, generator=g).to(c.dtype)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=g)
    pos[0], pos[1] = 0, MAX_POS - 1
    bad = torch.zeros(tokens, dtype=torch.bool)
    if c.bad_positions:
        for i, p in zip((2, 5, 7, 10), (-1, MAX_POS, 2**40, -(2**40))):
            pos[i] = p
            bad[i] = True
    q = qkv[:, : h * hs]
    k = qkv[:, h * hs:(h + kvh) * hs]
    safe = pos.clamp(0, MAX_POS - 1)  # the reference's rows for the bad tokens are ignored
    want = qkv.double().clone()
    want[:, : h * hs] = ref_rotate(q, safe, table, hs, c.neox)
    want[:, h * hs:(h + kvh) * hs] = ref_rotate(k, safe, table, hs, c.neox)
    cd = case_dir(root, c.id)
    cd.set(op="rotary_embedding", dtype=CODE[c.dtype], num_tokens=tokens, num_heads=h,
           num_kv_heads=kvh, head_size=hs, rot_dim=rot, max_position=MAX_POS,
           q_stride=qkv.stride(0), k_stride=qkv.stride(0), is_neox=int(c.neox), table=c.table,
           q_offset=0, k_offset=h * hs)
    cd.buf("qkv_storage", qkv, out=True)
    cd.buf("positions", pos)
    cd.buf("cos_sin_cache", table, out=True)
    cd.write()
    return cd, (qkv, table, want, bad)


# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    want = harness.selected(request, "case") | harness.selected(request, "name")
    root = tmp_path_factory.mktemp("emu_elementwise")
    prepared = {c.id: _prepare_norm(c, root) for c in NORM_CASES if c.id in want}
    prepared.update({c.id: _prepare_fused(c, root) for c in FUSED_CASES if c.id in want})
    prepared.update({c.id: _prepare_silu(c, root) for c in SILU_CASES if c.id in want})
    prepared.update({c.id: _prepare_rotary(c, root) for c in ROTARY_CASES if c.id in want})
    results = harness.run_cases([cd.path for cd, _ in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


def _ok(runs, case_id):
    prepared, results = runs
    cd, data = prepared[case_id]
    res = results[cd.path]
    assert res.ok, res.message
    return cd, data


SEED_PARAM = pytest.mark.parametrize("seed", harness.seed_params())


@SEED_PARAM
@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.id)
def test_rms_norm_emulated(runs, case, seed):
    cd, (storage, w, out, want) = _ok(runs, case.id)
    got = cd.read("out", seed, out)
    assert not got.isnan().any(), "out: elements left unwritten (NaN)"
    assert_two_step_close(got, want, case.dtype, 4.0, "rms_norm out")
    assert_bitwise_equal(cd.read("input_storage", seed, storage), storage,
                         "input (and the gaps between its rows) must not be modified")
    assert_bitwise_equal(cd.read("weight", seed, w), w, "weight must not be modified")


@SEED_PARAM
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_add_rms_norm_emulated(runs, case, seed):
    cd, (x, r, w, total, cands, other) = _ok(runs, case.id)
    want = cands[0]
    res = cd.read("residual", seed, r)
    # One rounding of an exact float32 add: bit for bit.
    assert torch.equal(res.double(), total), "residual != round_T(input + residual)"
    got = cd.read("input", seed, x)
    assert_two_step_close(got, cands, case.dtype, 4.0, "fused_add_rms_norm input")
    assert_bitwise_equal(cd.read("weight", seed, w), w, "weight must not be modified")
    if case.layout == "big_residual":
        # Where the rounded and the unrounded sum's variance give different outputs, the
        # kernel must side with the rounded one (the float32 sum order flips a few ties).
        diff = want != other
        assert diff.double().mean() > 0.2, "case cannot tell the two variances apart"
        agree = (got.double()[diff] == want[diff]).double().mean().item()
        assert agree >= 0.9, f"only {agree:.2%} of the distinguishing outputs match"


@SEED_PARAM
@pytest.mark.parametrize("case", SILU_CASES, ids=lambda c: c.id)
def test_silu_and_mul_emulated(runs, case, seed):
    cd, (storage, out, want) = _ok(runs, case.id)
    got = cd.read("out", seed, out)
    assert not got[~want[0].isnan()].isnan().any(), "out: elements left unwritten (NaN)"
    # float32: silu within ~4 ulps (exp within 1, products, a sum, a division), then the
    # product with up.
    assert_two_step_close(got, want, case.dtype, 8.0, "silu_and_mul out")
    assert_bitwise_equal(cd.read("input_storage", seed, storage), storage,
                         "input (and the gaps between its rows) must not be modified")


@SEED_PARAM
@pytest.mark.parametrize("case", ROTARY_CASES, ids=lambda c: c.id)
def test_rotary_embedding_emulated(runs, case, seed):
    cd, (qkv, table, want, bad) = _ok(runs, case.id)
    got = cd.read("qkv_storage", seed, qkv).double()
    hs, rot = case.head_size, case.rot_dim
    qk = (case.heads + case.kv_heads) * hs
    # Bad positions: the rotated dims of those tokens are unspecified (some clamped row);
    # everything else, including their unrotated dims, is exact.
    free = torch.zeros(got.shape[0], case.heads + case.kv_heads, hs, dtype=torch.bool)
    free[bad, :, :rot] = True
    mask = torch.ones_like(got, dtype=torch.bool)
    mask[:, :qk] = ~free.reshape(got.shape[0], qk)
    assert torch.equal(got[mask], want[mask]), (
        f"{int((got[mask] != want[mask]).sum())} elements differ from the reference")
    assert torch.equal(got[:, qk:], qkv[:, qk:].double()), "columns after q / k were modified"
    assert not got.isnan().any()
    assert_bitwise_equal(cd.read("cos_sin_cache", seed, table), table,
                         "cos_sin_cache must not be modified")
