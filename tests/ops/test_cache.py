"""reshape_and_cache(_flash), copy_blocks and swap_blocks: exact comparisons.

The caches start as NaN (or random data for the block copies); after the call every
element must equal the reference bit for bit: written slots hold key / k_scale (exact for
scale 1 and powers of two; within one rounding of the dtype for other scales, the rest
still bitwise), negative slots write nothing, everything else is untouched.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_lite import ops

from .reference import (
    DTYPES,
    assert_bitwise_equal,
    dtype_name,
    elem_x,
    ref_reshape_and_cache,
)

def _cache_cases():
    rng = random.Random(99)
    heads_dims = [(1, 64), (2, 80), (4, 128), (8, 256), (3, 40), (2, 8), (1, 72), (2, 96)]
    block_sizes = [8, 16, 32, 1, 7, 24]
    scales = [(1.0, 1.0), (1.0, 1.0), (0.5, 4.0), (0.3, 1.7)]
    inputs = ["contiguous", "fused_qkv"]
    cases = []
    i = 0
    for flash in (False, True):
        for dt in DTYPES:
            for _ in range(4):
                kvh, d = heads_dims[i % len(heads_dims)]
                bs = block_sizes[(i * 5) % len(block_sizes)]
                ks, vs = scales[i % len(scales)]
                inp = inputs[(i // 2) % 2]
                n = rng.choice([1, 13, 64, 200])
                cases.append(pytest.param(
                    flash, dt, kvh, d, bs, ks, vs, inp, n,
                    id=f"{'flash' if flash else 'paged'}-{dtype_name(dt)}-k{kvh}-d{d}-b{bs}"
                       f"-s{ks}_{vs}-{inp}-n{n}",
                ))
                i += 1
    return cases


def _make_kv(n, kvh, d, dtype, device, g, kind, num_heads=4):
    if kind == "fused_qkv":  # slices of a fused [n, (h + 2 kvh) * d] projection
        qkv = torch.randn(n, (num_heads + 2 * kvh) * d, generator=g).to(dtype).to(device)
        key = qkv[:, num_heads * d:(num_heads + kvh) * d].view(n, kvh, d)
        value = qkv[:, (num_heads + kvh) * d:].view(n, kvh, d)
        assert n == 1 or key.stride(0) == (num_heads + 2 * kvh) * d
    else:
        key = torch.randn(n, kvh, d, generator=g).to(dtype).to(device)
        value = torch.randn(n, kvh, d, generator=g).to(dtype).to(device)
    return key, value


def _empty_caches(flash, num_blocks, kvh, d, bs, dtype, device):
    if flash:
        shape_k = shape_v = (num_blocks, bs, kvh, d)
    else:
        x = elem_x(dtype)
        shape_k, shape_v = (num_blocks, kvh, d // x, bs, x), (num_blocks, kvh, d, bs)
    kc = torch.full(shape_k, float("nan"), dtype=dtype, device=device)
    vc = torch.full(shape_v, float("nan"), dtype=dtype, device=device)
    return kc, vc


def _write(flash, *args):
    (ops.reshape_and_cache_flash if flash else ops.reshape_and_cache)(*args)


def _check_written(actual, expected, exact, dtype, what):
    if exact:
        assert_bitwise_equal(actual, expected, what)
        return
    a, e = actual.cpu(), expected.cpu()
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: written/untouched slots differ"
    m = ~e.isnan()
    # key / scale for a scale that is not a power of two: one rounding of the dtype.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a[m].double(), e[m].double(), atol=1e-30, rtol=eps,
                               msg=lambda s: f"{what}: {s}")


@pytest.mark.parametrize("flash,dtype,kvh,d,bs,k_scale,v_scale,kind,n", _cache_cases())
def test_reshape_and_cache(device, flash, dtype, kvh, d, bs, k_scale, v_scale, kind, n):
    g = torch.Generator().manual_seed(n * 1000 + d + bs)
    num_blocks = (n + bs - 1) // bs + 3
    key, value = _make_kv(n, kvh, d, dtype, device, g, kind)
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    # Padding: -1 and other negative values; never the whole batch unless n == 1.
    pad = torch.randperm(n, generator=g)[: n // 4]
    slots[pad] = torch.tensor([-1, -7, -(2**40)] * n)[: len(pad)]
    slots = slots.to(device)
    kc, vc = _empty_caches(flash, num_blocks, kvh, d, bs, dtype, device)
    want_k, want_v = ref_reshape_and_cache(key, value, kc, vc, slots, k_scale, v_scale, flash)
    key_before, value_before = key.clone(), value.clone()
    _write(flash, key, value, kc, vc, slots, "auto", k_scale, v_scale)
    exact = all(s in (1.0, 0.5, 2.0, 4.0, 0.25) for s in (k_scale, v_scale))
    _check_written(kc, want_k, exact, dtype, "key_cache")
    _check_written(vc, want_v, exact, dtype, "value_cache")
    assert_bitwise_equal(key, key_before, "key must not be modified")
    assert_bitwise_equal(value, value_before, "value must not be modified")


@pytest.mark.parametrize("flash", [False, True], ids=["paged", "flash"])
def test_reshape_and_cache_edge_slots(device, flash):
    """All-padding batches write nothing; an empty batch is a no-op; the first and last
    slot of the pool are written."""
    dtype, kvh, d, bs, nb = torch.float16, 2, 64, 16, 4
    g = torch.Generator().manual_seed(11)
    key, value = _make_kv(3, kvh, d, dtype, device, g, "contiguous")
    kc, vc = _empty_caches(flash, nb, kvh, d, bs, dtype, device)
    kc0, vc0 = kc.clone(), vc.clone()
    _write(flash, key, value, kc, vc, torch.full((3,), -1, dtype=torch.long, device=device),
           "auto", 1.0, 1.0)
    assert_bitwise_equal(kc, kc0, "key_cache after an all-padding batch")
    assert_bitwise_equal(vc, vc0, "value_cache after an all-padding batch")
    _write(flash, key[:0], value[:0], kc, vc,
           torch.empty(0, dtype=torch.long, device=device), "auto", 1.0, 1.0)
    assert_bitwise_equal(kc, kc0, "key_cache after an empty batch")
    slots = torch.tensor([nb * bs - 1, -1, 0], dtype=torch.long, device=device)
    want_k, want_v = ref_reshape_and_cache(key, value, kc, vc, slots, flash=flash)
    _write(flash, key, value, kc, vc, slots, "auto", 1.0, 1.0)
    assert_bitwise_equal(kc, want_k, "key_cache")
    assert_bitwise_equal(vc, want_v, "value_cache")


def test_reshape_and_cache_then_attention_roundtrip(device):
    """Tokens written with reshape_and_cache are what paged_attention reads (k_scale and
    v_scale cancel: the cache stores key / k_scale, attention multiplies by k_scale)."""
    from .reference import ref_paged_attention, tol

    dtype, h, kvh, d, bs = torch.bfloat16, 8, 2, 128, 16
    g = torch.Generator().manual_seed(12)
    lens = [37, 600]
    nb = sum((n + bs - 1) // bs for n in lens) + 2
    ids = torch.randperm(nb, generator=g)
    tables = torch.zeros(2, 40, dtype=torch.int32)
    slots, pos = [], 0
    for s, n in enumerate(lens):
        need = (n + bs - 1) // bs
        tables[s, :need] = ids[pos:pos + need].int()
        pos += need
        slots += [int(tables[s, t // bs]) * bs + t % bs for t in range(n)]
    key = torch.randn(sum(lens), kvh, d, generator=g).to(dtype).to(device)
    value = torch.randn(sum(lens), kvh, d, generator=g).to(dtype).to(device)
    kc, vc = _empty_caches(False, nb, kvh, d, bs, dtype, device)
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor(slots, device=device), "auto",
                          0.5, 2.0)
    q = torch.randn(2, h, d, generator=g).to(dtype).to(device)
    out = torch.full_like(q, float("nan"))
    tables, seq_lens = tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    ops.paged_attention_v1(out, q, kc, vc, kvh, d**-0.5, tables, seq_lens, bs, 600, None,
                           "auto", 0.5, 2.0)
    ref, _ = ref_paged_attention(q, kc, vc, kvh, d**-0.5, tables, seq_lens, bs, None, 0.5, 2.0)
    torch.testing.assert_close(out.cpu().double(), ref, **tol(dtype))
    # Against the original (unscaled) key/value, directly: scales are powers of two.
    ks = torch.split(key.cpu().double(), lens)
    vs = torch.split(value.cpu().double(), lens)
    for s in range(2):
        k = ks[s].repeat_interleave(h // kvh, 1).transpose(0, 1)
        v = vs[s].repeat_interleave(h // kvh, 1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[s].cpu().double()[:, None], k, v, scale=d**-0.5)[:, 0]
        torch.testing.assert_close(out[s].cpu().double(), want, **tol(dtype))


# ---------------------------------------------------------------------------------------
# copy_blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", ["paged", "flash"])
def test_copy_blocks(device, dtype, layout):
    g = torch.Generator().manual_seed(21)
    layers, nb, kvh, d, bs = 3, 12, 2, 64, 16
    x = elem_x(dtype)
    if layout == "paged":
        shape_k, shape_v = (nb, kvh, d // x, bs, x), (nb, kvh, d, bs)
    else:
        shape_k = shape_v = (nb, bs, kvh, d)
    kcs = [torch.randn(shape_k, generator=g).to(dtype).to(device) for _ in range(layers)]
    vcs = [torch.randn(shape_v, generator=g).to(dtype).to(device) for _ in range(layers)]
    kcs[1][5] = float("nan")  # NaN payloads copy bit for bit too
    # Block 2 copied to two destinations; 5 -> 0; 11 -> 7 (the last block).
    mapping = torch.tensor([[2, 9], [2, 3], [5, 0], [11, 7]], dtype=torch.long)
    want_k = [k.cpu().clone() for k in kcs]
    want_v = [v.cpu().clone() for v in vcs]
    for src, dst in mapping.tolist():
        for w, orig in zip(want_k + want_v, kcs + vcs):
            w[dst] = orig[src].cpu()
    ops.copy_blocks(kcs, vcs, mapping.to(device))
    for i in range(layers):
        assert_bitwise_equal(kcs[i], want_k[i], f"key_caches[{i}]")
        assert_bitwise_equal(vcs[i], want_v[i], f"value_caches[{i}]")


def test_copy_blocks_empty(device):
    kc = torch.randn(4, 2, 8, 16, 4, device=device)
    vc = torch.randn(4, 2, 32, 16, device=device)
    k0, v0 = kc.clone(), vc.clone()
    ops.copy_blocks([kc], [vc], torch.empty(0, 2, dtype=torch.long, device=device))
    assert_bitwise_equal(kc, k0, "key cache")
    assert_bitwise_equal(vc, v0, "value cache")
    ops.copy_blocks([], [], torch.tensor([[0, 1]], dtype=torch.long, device=device))


# ---------------------------------------------------------------------------------------
# swap_blocks


SWAP_DIRECTIONS = {
    "cpu": [("cpu", "cpu")],
    "cuda": [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda"), ("cpu_pinned", "cuda"),
             ("cuda", "cpu_pinned")],
}


def _alloc(where: str, t: torch.Tensor) -> torch.Tensor:
    if where == "cpu_pinned":
        return t.pin_memory()
    return t.to(where)


@pytest.mark.parametrize("dtype", DTYPES + (torch.uint8,), ids=dtype_name)
def test_swap_blocks(device, dtype):
    g = torch.Generator().manual_seed(31)
    for src_dev, dst_dev in SWAP_DIRECTIONS[device]:
        shape = (2, 32, 16, 8)  # [num_blocks, ...]: any layout, one block is one slab
        src = _alloc(src_dev, (torch.randn((9,) + shape[1:], generator=g) * 50).to(dtype))
        dst = _alloc(dst_dev, torch.full((6,) + shape[1:], 77).to(dtype))
        mapping = torch.tensor([[8, 0], [0, 5], [3, 2], [3, 4]], dtype=torch.long)
        want = dst.cpu().clone()
        for s, d in mapping.tolist():
            want[d] = src[s].cpu()
        src_before = src.cpu().clone()
        ops.swap_blocks(src, dst, mapping)
        if dst.is_cuda:
            torch.cuda.synchronize()
        assert_bitwise_equal(dst, want, f"dst ({src_dev} -> {dst_dev})")
        assert_bitwise_equal(src, src_before, f"src ({src_dev} -> {dst_dev})")


def test_swap_blocks_empty_mapping(device):
    src = torch.randn(3, 4, 8, device=device)
    dst = torch.randn(3, 4, 8)
    d0 = dst.clone()
    ops.swap_blocks(src, dst, torch.empty(0, 2, dtype=torch.long))
    assert_bitwise_equal(dst, d0, "dst")
