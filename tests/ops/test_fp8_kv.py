"""fp8 KV cache on the CPU kernels (kv_cache_dtype "fp8" = "fp8_e4m3", "fp8_e5m2"; uint8
caches with x = 16, as vLLM):

- reshape_and_cache(_flash) stores key / k_scale and value / v_scale bit for bit as torch's
  float8_e4m3fn / float8_e5m2 casts of the float32 quotient, over every kind of input
  (normals, subnormals, ties, overflow, inf, NaN), leaves padding slots and the rest of the
  NaN-poisoned cache alone;
- paged attention (v1 and v2, every CPU ISA build) over fp8 caches against a float64
  reference on the dequantized cache (stored value x scale), unused slots NaN;
- copy_blocks / swap_blocks move fp8 blocks bit for bit;
- bad values (unknown kv_cache_dtype, an fp8 string with a non-uint8 cache, a uint8 cache
  with "auto", scale <= 0 or not finite) raise before anything is written.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_lite import ops

from .reference import (DTYPES, FP8_DTYPES, assert_bitwise_equal, dtype_name, fp8_bytes,
                        make_paged_kv, nan_like, ref_paged_attention, ref_reshape_and_cache,
                        split_to_flash, to_fp8_caches, tol)

FP8 = FP8_DTYPES
NAN_BYTE = 0x7F  # NaN in both formats (e5m2: S.11111.11)


def _interesting_floats() -> torch.Tensor:
    """float32 values covering both formats' conversion paths."""
    parts = []
    # Every 4099th float32 bit pattern (all exponents, signs, NaNs, infinities).
    parts.append(torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32)
                 .view(torch.float32))
    # Every fp8 value of both formats, and the floats just around each one and around
    # each midpoint (round-half-to-even ties and their neighbours).
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        v = v[torch.isfinite(v)].unique()
        mids = (v[1:] + v[:-1]) / 2
        for t in (v, mids):
            b = t.view(torch.int32)
            for d in (-2, -1, 0, 1, 2):
                parts.append((b + d).view(torch.float32))
    parts.append(torch.tensor([0.0, -0.0, 448.0, 463.99, 464.0, 480.0, 57344.0, 61439.0,
                               61440.0, 65536.0, 1e30, float("inf"), -float("inf"),
                               float("nan"), 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16,
                               2.0**-17, 3 * 2.0**-18, 1e-45]))
    x = torch.cat(parts)
    return torch.cat([x, -x])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_conversion_matches_torch_bit_for_bit(kv_cache_dtype: str) -> None:
    x = _interesting_floats()
    d = 64
    n = (x.numel() + d - 1) // d
    x = torch.cat([x, torch.zeros(n * d - x.numel())]).view(n, 1, d)
    slots = torch.randperm(n + 5)[:n]
    kc = torch.full((n + 5, 1, 1, d), NAN_BYTE, dtype=torch.uint8)
    vc = kc.clone()
    ops.reshape_and_cache_flash(x, -x, kc, vc, slots, kv_cache_dtype, 1.0, 1.0)
    want_k, want_v = torch.full_like(kc, NAN_BYTE), torch.full_like(vc, NAN_BYTE)
    want_k[slots, 0] = fp8_bytes(x, kv_cache_dtype, 1.0)
    want_v[slots, 0] = fp8_bytes(-x, kv_cache_dtype, 1.0)
    for got, want, what in ((kc, want_k, "key"), (vc, want_v, "value")):
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (
            f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
            f"got {int(got[tuple(bad[0])]):#04x}, want {int(want[tuple(bad[0])]):#04x}")


def _cases():
    rng = random.Random(7)
    cases = []
    for i, (flash, dt, fmt) in enumerate([(f, dt, fmt) for f in (False, True) for dt in DTYPES
                                          for fmt in ("fp8", "fp8_e5m2")]):
        # The paged layout's fp8 key chunks are 16 elements: head sizes 40 / 72 fit only
        # the flash layout (test_head_size_not_a_multiple_of_16_is_refused).
        kvh, d = ([(1, 64), (2, 80), (3, 40), (4, 128), (2, 72), (1, 16)] if flash else
                  [(1, 64), (2, 80), (4, 128), (2, 256), (1, 16), (3, 48)])[i % 6]
        bs = [16, 8, 32, 1, 7][i % 5]
        ks, vs = [(1.0, 1.0), (0.37, 2.5), (1e-3, 30.0)][i % 3]
        n = rng.choice([1, 13, 64])
        cases.append(pytest.param(flash, dt, fmt, kvh, d, bs, ks, vs, n,
                                  id=f"{'flash' if flash else 'paged'}-{dtype_name(dt)}-{fmt}"
                                     f"-k{kvh}-d{d}-b{bs}-s{ks}_{vs}-n{n}"))
    return cases


@pytest.mark.parametrize("flash,dtype,fmt,kvh,d,bs,k_scale,v_scale,n", _cases())
def test_reshape_and_cache_fp8(flash, dtype, fmt, kvh, d, bs, k_scale, v_scale, n) -> None:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # Values spread over many binades (subnormal to overflow after the scale).
    key = (torch.randn(n, kvh, d, generator=g) * torch.exp2(torch.randint(-12, 10, (n, kvh, d),
                                                                          generator=g))).to(dtype)
    value = (torch.randn(n, kvh, d, generator=g) * 4).to(dtype)
    num_blocks = (n + bs - 1) // bs + 3
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1  # padding
    if flash:
        shape_k = shape_v = (num_blocks, bs, kvh, d)
    else:
        shape_k, shape_v = (num_blocks, kvh, d // 16, bs, 16), (num_blocks, kvh, d, bs)
    kc = torch.full(shape_k, NAN_BYTE, dtype=torch.uint8)
    vc = torch.full(shape_v, NAN_BYTE, dtype=torch.uint8)
    write = ops.reshape_and_cache_flash if flash else ops.reshape_and_cache
    write(key, value, kc, vc, slots, fmt, k_scale, v_scale)
    # The bytes torch's cast gives, placed by the shared reference (scale 1: no rescaling).
    want_k, want_v = ref_reshape_and_cache(
        fp8_bytes(key, fmt, k_scale), fp8_bytes(value, fmt, v_scale),
        torch.full(shape_k, NAN_BYTE, dtype=torch.uint8),
        torch.full(shape_v, NAN_BYTE, dtype=torch.uint8), slots, flash=flash)
    assert_bitwise_equal(kc, want_k, "key_cache")
    assert_bitwise_equal(vc, want_v, "value_cache")


def _attention_cases():
    cases = []
    for i, (fmt, dt) in enumerate([(f, dt) for f in ("fp8", "fp8_e5m2") for dt in DTYPES]):
        lens = [[1, 17, 300], [700, 5, 1100], [64], [513, 0, 33]][i % 4]
        kvh, group, d = [(2, 4, 64), (1, 8, 128), (3, 3, 80), (2, 1, 256), (1, 2, 16)][i % 5]
        bs = [16, 8, 32, 5][i % 4]
        for flash in (False, True) if i % 2 == 0 else (False,):
            cases.append(pytest.param(fmt, dt, lens, kvh, group, d, bs, flash,
                                      id=f"{fmt}-{dtype_name(dt)}-L{'_'.join(map(str, lens))}"
                                         f"-k{kvh}g{group}-d{d}-b{bs}{'-flash' if flash else ''}"))
    return cases


@pytest.mark.parametrize("fmt,dtype,lens,kvh,group,d,bs,flash", _attention_cases())
def test_paged_attention_fp8_against_float64(fmt, dtype, lens, kvh, group, d, bs, flash) -> None:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    kv = make_paged_kv(lens, kvh, d, bs, torch.float32, "cpu", g)
    k_scale, v_scale = 0.05, 0.5
    k8, v8, kd, vd = to_fp8_caches(kv, fmt, k_scale, v_scale)
    # Unused slots were NaN and stay NaN bytes: the kernel must never read them.
    assert (k8 == NAN_BYTE).any() or sum(lens) % bs == 0
    q = torch.randn(len(lens), kvh * group, d, generator=g).to(dtype)
    scale = d ** -0.5
    want, _ = ref_paged_attention(q, kd, vd, kvh, scale, kv.block_tables, kv.seq_lens, bs)
    if flash:  # the same bytes in the flash layout (the kernel tells it by the key's rank)
        k8, v8 = split_to_flash(k8, v8)
    isa = ops.cpu_isa()
    try:
        for name in ops.cpu_isas():
            ops.set_cpu_isa(name)
            out = nan_like(q)
            ops.paged_attention(q, k8, v8, kvh, scale, kv.block_tables, kv.seq_lens, bs,
                                max(lens), None, fmt, k_scale, v_scale, out=out)
            torch.testing.assert_close(out.double(), want, **tol(dtype),
                                       msg=lambda m, name=name: f"ISA {name}: {m}")
    finally:
        ops.set_cpu_isa(isa)


def test_copy_and_swap_fp8_blocks() -> None:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    shape = (6, 2, 4, 8, 16)
    kc = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 256, (6, 2, 64, 8), dtype=torch.uint8, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    ops.copy_blocks([kc], [vc], torch.tensor([[0, 3], [5, 1]]))
    want_k[3], want_k[1], want_v[3], want_v[1] = want_k[0], want_k[5], want_v[0], want_v[5]
    assert_bitwise_equal(kc, want_k, "copied key blocks")
    assert_bitwise_equal(vc, want_v, "copied value blocks")
    dst = torch.full((3, *shape[1:]), NAN_BYTE, dtype=torch.uint8)
    ops.swap_blocks(kc, dst, torch.tensor([[4, 2], [0, 0]]))
    assert torch.equal(dst[2], kc[4]) and torch.equal(dst[0], kc[0])
    assert (dst[1] == NAN_BYTE).all()


def _write_args(fmt="fp8", cache_dtype=torch.uint8, k_scale=1.0, v_scale=1.0):
    key = torch.randn(3, 2, 32)
    kc = torch.full((4, 2, 2, 4, 16), 7, dtype=torch.uint8).to(cache_dtype)
    vc = torch.full((4, 2, 32, 4), 7, dtype=torch.uint8).to(cache_dtype)
    return key, key.clone(), kc, vc, torch.tensor([0, 5, 9]), fmt, k_scale, v_scale


@pytest.mark.parametrize("change,message", [
    (dict(fmt="fp8_e4m3fnuz"), "kv_cache_dtype 'fp8_e4m3fnuz' is not supported"),
    (dict(fmt="int8"), "kv_cache_dtype 'int8' is not supported"),
    (dict(fmt="auto"), "for kv_cache_dtype 'auto'"),
    (dict(cache_dtype=torch.float32), "must be uint8"),
    (dict(k_scale=0.0), "k_scale and v_scale must be finite and positive"),
    (dict(v_scale=-1.0), "k_scale and v_scale must be finite and positive"),
    (dict(k_scale=float("nan")), "k_scale and v_scale must be finite and positive"),
    (dict(v_scale=float("inf")), "k_scale and v_scale must be finite and positive"),
])
def test_bad_fp8_arguments_raise_before_writing(change, message) -> None:
    args = _write_args(**change)
    kc, vc = args[2].clone(), args[3].clone()
    for op in (ops.reshape_and_cache,):
        with pytest.raises(RuntimeError, match=message):
            op(*args)
        assert torch.equal(args[2], kc) and torch.equal(args[3], vc)  # nothing written
    q = torch.randn(1, 4, 32)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    out = nan_like(q)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(q, args[2], args[3], 2, 0.1, tables,
                            torch.tensor([5], dtype=torch.int32), 4, 5, None, *args[5:],
                            out=out)
    assert out.isnan().all()


def test_fp8_cache_with_a_model_dtype_layout_is_refused() -> None:
    """An fp8 key cache keeps x = 16 (16 bytes): the float32 layout's x = 4 is refused."""
    key = torch.randn(2, 1, 32)
    kc = torch.zeros(3, 1, 8, 4, 4, dtype=torch.uint8)
    vc = torch.zeros(3, 1, 32, 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"key_cache must have shape \[3, 1, 2, 4, 16\]"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]), "fp8", 1.0, 1.0)


def test_head_size_not_a_multiple_of_16_is_refused() -> None:
    key = torch.randn(2, 1, 40)
    kc = torch.zeros(3, 1, 2, 4, 16, dtype=torch.uint8)
    vc = torch.zeros(3, 1, 40, 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="head_size 40 must be a multiple of 16"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]), "fp8", 1.0, 1.0)
    assert not kc.any() and not vc.any()
    q = torch.randn(1, 2, 40)
    with pytest.raises(RuntimeError, match="head_size 40 must be a multiple of 16"):
        ops.paged_attention(q, kc, vc, 1, 0.1, torch.tensor([[0]], dtype=torch.int32),
                            torch.tensor([2], dtype=torch.int32), 4, 2, None, "fp8")
