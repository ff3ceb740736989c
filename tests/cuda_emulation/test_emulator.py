"""The SIMT emulator itself: conversions bit-exact with CUDA's (checked against torch's
round-to-nearest-even), shuffle results, barriers, and that every class of bug it claims
to catch (missing barrier, uninitialised shared memory, deadlock, divergent barrier,
mismatched shuffle masks, out-of-bounds shared / global accesses, misaligned vector loads)
is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

SEEDS = [0, 1, 2, 3]


def _selftest(tmp, name, out_bytes, inp=None, seeds=SEEDS):
    c = case_dir(tmp, name)
    c.set(op="selftest", test=name)
    if inp is not None:
        c.buf("in", inp)
    c.buf("out", np.zeros(out_bytes, dtype=np.uint8), out=True)
    c.write()
    res = harness.run_cases([c.path], seeds)[c.path]
    return c, res


def test_conversions_match_torch(tmp_path):
    g = torch.Generator().manual_seed(3)
    parts = [
        torch.randn(20000, generator=g) * 10.0 ** torch.randint(-9, 6, (20000,), generator=g),
        torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e9, float("inf"),
                      -float("inf"), 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26,
                      3 * 2.0**-25, 2.0**-14, 2.0**-14 * (1 - 2.0**-11), 1e-45, 3.4e38]),
        # Every float exactly halfway between two halves / bfloat16s, and next to it.
        (torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
         .float()[torch.arange(0, 65536, 7)]),
    ]
    f = torch.cat(parts).float()
    f = f[~f.isnan()]
    mids = torch.arange(0, 1 << 16, 3, dtype=torch.int64) << 16 | 0x8000  # bf16 ties
    f = torch.cat([f, mids.to(torch.int32).view(torch.float32)])
    f = f[~f.isnan()]
    c = case_dir(tmp_path, "convert")
    c.set(op="convert")
    c.buf("floats", f)
    n = f.numel()
    c.buf("to_half", np.zeros(2 * n, np.uint8), out=True)
    c.buf("to_bf16", np.zeros(2 * n, np.uint8), out=True)
    c.buf("from_half", np.zeros(4 * 65536, np.uint8), out=True)
    c.buf("from_bf16", np.zeros(4 * 65536, np.uint8), out=True)
    for fmt in ("e4m3", "e5m2"):
        for kind in ("from", "chunks"):
            c.buf(f"{kind}_fp8_{fmt}", np.full(4 * 256, 0xFF, np.uint8), out=True)
    c.write()
    res = harness.run_cases([c.path], [0])[c.path]
    assert res.ok, res.message
    h = c.read("to_half", 0, torch.empty(n, dtype=torch.int16))
    b = c.read("to_bf16", 0, torch.empty(n, dtype=torch.int16))
    want_h = f.to(torch.float16).view(torch.int16)
    want_b = f.to(torch.bfloat16).view(torch.int16)
    bad = (h != want_h).nonzero()
    assert bad.numel() == 0, f"half: {f[bad[0]].item()!r} -> {h[bad[0]].item():#x}, torch {want_h[bad[0]].item():#x}"
    bad = (b != want_b).nonzero()
    assert bad.numel() == 0, f"bf16: {f[bad[0]].item()!r} -> {b[bad[0]].item():#x}, torch {want_b[bad[0]].item():#x}"
    # Every 16-bit pattern back to float (NaNs: both NaN).
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for name, dt in (("from_half", torch.float16), ("from_bf16", torch.bfloat16)):
        got = c.read(name, 0, torch.empty(65536, dtype=torch.float32))
        want = allbits.view(dt).float()
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), name
    # Every fp8 byte through the kernels' decoders: exact (NaNs: both NaN).
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
        for kind in ("from", "chunks"):
            got = c.read(f"{kind}_fp8_{fmt}", 0, torch.empty(256, dtype=torch.float32))
            same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
            bad = (~same).nonzero()
            assert bad.numel() == 0, (f"{kind} fp8_{fmt}: byte {bad[0].item():#x} -> "
                                      f"{got[bad[0]].item()!r}, torch {want[bad[0]].item()!r}")


def test_shuffles(tmp_path):
    c, res = _selftest(tmp_path, "shuffle", 64 * 4 * 4)
    assert res.ok, res.message
    for seed in SEEDS:
        out = c.read("out", seed, torch.empty(64, 4, dtype=torch.int32))
        for t in range(64):
            lane, warp = t % 32, t // 32
            v = lambda l: (l + 1) * (warp + 1)  # noqa: E731
            assert out[t, 0] == sum(v(l) for l in range(32))
            assert out[t, 1] == v(3)
            assert out[t, 2] == (v(lane + 1) if lane < 31 else v(lane))
            assert out[t, 3] == (v(lane - 2) if lane >= 2 else v(lane))


def test_barrier_orders_shared_memory(tmp_path):
    c, res = _selftest(tmp_path, "barrier", 128 * 4)
    assert res.ok, res.message
    want = torch.tensor([((t + 1) % 128) * 2 for t in range(128)], dtype=torch.int32)
    for seed in SEEDS:
        assert torch.equal(c.read("out", seed, want), want)


def test_missing_barrier_is_visible(tmp_path):
    """Without the barrier, threads read slots their neighbour has not written yet."""
    c, res = _selftest(tmp_path, "missing_barrier", 128 * 4)
    assert res.ok, res.message
    want = torch.tensor([((t + 1) % 128) * 2 for t in range(128)], dtype=torch.int32)
    for seed in SEEDS:
        assert not torch.equal(c.read("out", seed, want), want), seed


def test_uninitialised_shared_memory_is_nan(tmp_path):
    c, res = _selftest(tmp_path, "uninit_shared", 64 * 4)
    assert res.ok, res.message
    out = c.read("out", 0, torch.empty(64, dtype=torch.int32))
    assert bool((out == 0x7FAB7FAB).all())
    assert bool(out.view(torch.float32).isnan().all())


@pytest.mark.parametrize("name,expect", [
    ("deadlock", "deadlock"),
    ("divergent_barrier", "divergent barrier"),
    ("mask_mismatch", "mask 0x"),
    ("smem_oob", "AddressSanitizer"),
    ("global_oob", "heap-buffer-overflow"),
    ("local_oob", "stack-buffer-overflow"),
    ("misaligned", "misaligned address"),
])
def test_bugs_are_caught(tmp_path, name, expect):
    inp = np.arange(64, dtype=np.float32)
    _, res = _selftest(tmp_path, name, 128 * 4, inp=inp, seeds=[0])
    assert not res.ok, f"{name} ran without an error"
    assert expect in res.message, res.message


# ---- the tensor-core and async-copy instructions (csrc/cuda/mma.cuh; emu_tensor.cpp)


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_fragments(tmp_path, trans):
    """ldmatrix.x4 against the PTX ISA's layout, written out here independently: lane l
    passes the address of shared row (5 l + 3) % 32, lanes 8j..8j+7 name matrix j's rows
    0..7, and register j of lane i holds row i/4, columns 2(i%4), 2(i%4)+1 of matrix j
    (.trans: rows 2(i%4), 2(i%4)+1 of column i/4)."""
    g = torch.Generator().manual_seed(11)
    vals = torch.randint(0, 1 << 16, (32, 8), generator=g, dtype=torch.int32)
    name = "ldmatrix_trans" if trans else "ldmatrix"
    c, res = _selftest(tmp_path, name, 32 * 4 * 4, inp=vals.to(torch.int16).numpy(), seeds=[0, 1])
    assert res.ok, res.message
    for seed in (0, 1):
        out = c.read("out", seed, torch.empty(32, 4, dtype=torch.int32)).long() & 0xFFFFFFFF
        for lane in range(32):
            for j in range(4):
                mat = [vals[((8 * j + r) * 5 + 3) % 32] for r in range(8)]  # rows of matrix j
                r, col = lane // 4, 2 * (lane % 4)
                e0, e1 = (mat[col][r], mat[col + 1][r]) if trans else (mat[r][col], mat[r][col + 1])
                want = int(e0) | (int(e1) << 16)
                assert int(out[lane, j]) == want, (seed, lane, j)


@pytest.mark.parametrize("b_mode", [0, 1], ids=["b-ldmatrix-trans", "b-ldmatrix"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mma_m16n8k16(tmp_path, dtype, b_mode):
    """One m16n8k16 tile (operands through ldmatrix, D written by the accumulator layout)
    against A @ B + C in float64: equal to float32 rounding."""
    g = torch.Generator().manual_seed(5 + b_mode)
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    cacc = torch.randn(16, 8, generator=g)
    inp = np.concatenate([a.view(torch.int16).reshape(-1).numpy().view(np.uint8),
                          b.view(torch.int16).reshape(-1).numpy().view(np.uint8),
                          cacc.reshape(-1).numpy().view(np.uint8)])
    tag = "f16" if dtype == torch.float16 else "bf16"
    c, res = _selftest(tmp_path, f"mma_{tag}_{b_mode}", 128 * 4, inp=inp, seeds=[0, 3])
    assert res.ok, res.message
    want = (a.double() @ b.double() + cacc.double()).float()
    for seed in (0, 3):
        d = c.read("out", seed, torch.empty(16, 8, dtype=torch.float32))
        assert torch.equal(d, want), (seed, (d - want).abs().max())


def test_cp_async_lands_at_its_wait(tmp_path):
    """A cp.async copy is visible only after the wait_group that completes its group:
    before any wait both tiles read as the NaN poison, after wait_group 1 the first group
    has landed and the second has not, after wait_group 0 both (src-size 0: zeros)."""
    inp = np.arange(64 * 4, dtype=np.uint32) * 2654435761 % (1 << 31)
    c, res = _selftest(tmp_path, "cp_async", 3 * 64 * 16, inp=inp.astype(np.uint32), seeds=[0, 1, 2])
    assert res.ok, res.message
    src = torch.from_numpy(inp.astype(np.int64)).view(64, 4)
    poison = torch.full((32, 4), 0x7FAB7FAB, dtype=torch.int64)
    second = src[32:].clone()
    second[1::2] = 0  # odd threads zero-fill
    for seed in (0, 1, 2):
        out = c.read("out", seed, torch.empty(3, 2, 32, 4, dtype=torch.int32)).long()
        assert torch.equal(out[0, 0], poison) and torch.equal(out[0, 1], poison), seed
        assert torch.equal(out[1, 0], src[:32]) and torch.equal(out[1, 1], poison), seed
        assert torch.equal(out[2, 0], src[:32]) and torch.equal(out[2, 1], second), seed


@pytest.mark.parametrize("name,expect", [
    ("cp_async_unwaited", "no cp.async.wait_group completed"),
    ("cp_async_global_dst", "is not shared memory"),
])
def test_cp_async_misuse_is_caught(tmp_path, name, expect):
    inp = np.arange(64 * 4, dtype=np.uint32)
    _, res = _selftest(tmp_path, name, 64 * 16, inp=inp, seeds=[0])
    assert not res.ok, f"{name} ran without an error"
    assert expect in res.message, res.message
