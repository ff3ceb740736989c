"""reshape_and_cache(_flash), copy_blocks and swap_blocks of csrc/cuda, run on the CPU by
the SIMT emulator: bit-exact against tests/ops/reference.py (as
tests/ops/test_cache.py checks the real kernels).

Caches start as NaN (writes) or random data (copies). Slot mappings carry padding (-1,
-7, -2^40) and, as an unvalidated mapping under CUDA graph capture could, slots past the
pool: both must write nothing. Misaligned inputs take the kernels' element-wise paths.
Each case runs under every schedule seed of harness.seeds() (the first
by default, the others with --full-grid); each (case, seed) is a test.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import pytest
import torch

from ops.reference import (  # tests/ is on sys.path (rootdir-based packages)
    assert_bitwise_equal,
    dtype_name,
    elem_x,
    ref_reshape_and_cache,
)
from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CODE = {F32: "f32", F16: "f16", BF16: "bf16"}


@dataclass(frozen=True)
class WriteCase:
    id: str
    flash: bool
    dtype: torch.dtype
    kvh: int
    d: int
    bs: int
    k_scale: float
    v_scale: float
    kind: str  # contiguous | fused_qkv | misaligned
    n: int


def _write_cases() -> list[WriteCase]:
    rng = random.Random(5)
    hd = [(1, 64), (2, 80), (4, 128), (8, 256), (3, 40), (2, 8), (1, 72)]
    scales = [(1.0, 1.0), (0.5, 4.0), (1.0, 1.0), (0.3, 1.7)]
    kinds = ["contiguous", "fused_qkv", "misaligned"]
    cases, i = [], 0
    for flash in (False, True):
        for dt in (F32, F16, BF16):
            for _ in range(3):
                kvh, d = hd[i % len(hd)]
                bs = (8, 16, 32)[i % 3]
                ks, vs = scales[i % len(scales)]
                kind = kinds[(i // 2) % 3]
                n = rng.choice([1, 5, 13, 40])
                cases.append(WriteCase(
                    f"{'flash' if flash else 'paged'}-{dtype_name(dt)}-k{kvh}-d{d}-b{bs}"
                    f"-s{ks}_{vs}-{kind}-n{n}", flash, dt, kvh, d, bs, ks, vs, kind, n))
                i += 1
    return cases


WRITE_CASES = _write_cases()


def _prepare_write(c: WriteCase, root):
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    nb = (c.n + c.bs - 1) // c.bs + 2
    if c.kind == "fused_qkv":
        h = 4
        qkv = torch.randn(c.n, (h + 2 * c.kvh) * c.d, generator=g).to(c.dtype)
        key = qkv[:, h * c.d:(h + c.kvh) * c.d].view(c.n, c.kvh, c.d)
        value = qkv[:, (h + c.kvh) * c.d:].view(c.n, c.kvh, c.d)
    else:
        key = torch.randn(c.n, c.kvh, c.d, generator=g).to(c.dtype)
        value = torch.randn(c.n, c.kvh, c.d, generator=g).to(c.dtype)
    slots = torch.randperm(nb * c.bs, generator=g)[: c.n]
    pad = torch.randperm(c.n, generator=g)[: c.n // 3]
    bad = [-1, -7, -(2**40), nb * c.bs, 2**40]
    slots[pad] = torch.tensor([bad[j % len(bad)] for j in range(len(pad))], dtype=torch.long)
    if c.flash:
        shape_k = shape_v = (nb, c.bs, c.kvh, c.d)
    else:
        x = elem_x(c.dtype)
        shape_k, shape_v = (nb, c.kvh, c.d // x, c.bs, x), (nb, c.kvh, c.d, c.bs)
    kc = torch.full(shape_k, float("nan"), dtype=c.dtype)
    vc = torch.full(shape_v, float("nan"), dtype=c.dtype)
    valid = slots.clone()
    valid[(valid < 0) | (valid >= nb * c.bs)] = -1  # the reference skips negative slots
    want_k, want_v = ref_reshape_and_cache(key, value, kc, vc, valid, c.k_scale, c.v_scale,
                                           c.flash)
    ks, k_off = harness.storage_of(key)
    vs, v_off = harness.storage_of(value)
    # misaligned: the inputs start one element past a 16-byte boundary -> element paths.
    shift = key.element_size() if c.kind == "misaligned" else 0
    cd = case_dir(root, c.id)
    cd.set(op="reshape_and_cache", dtype=CODE[c.dtype], flash=int(c.flash), num_tokens=c.n,
           num_kv_heads=c.kvh, head_size=c.d, block_size=c.bs, num_blocks=nb,
           key_stride=key.stride(0), value_stride=value.stride(0), k_scale=c.k_scale,
           v_scale=c.v_scale, key_offset=k_off, value_offset=v_off)
    cd.buf("key_storage", ks, offset=shift, out=True)
    cd.buf("value_storage", vs, offset=shift, out=True)
    cd.buf("key_cache", kc, out=True)
    cd.buf("value_cache", vc, out=True)
    cd.buf("slot_mapping", slots)
    cd.write()
    return cd, (ks, vs, kc, vc, want_k, want_v)


@dataclass(frozen=True)
class CopyCase:
    id: str
    dtype: torch.dtype
    flash: bool
    misaligned: bool


COPY_CASES = [CopyCase(f"copy-{lay}-{dtype_name(dt)}{'-misaligned' if mis else ''}", dt,
                       lay == "flash", mis)
              for dt in (F32, F16, BF16) for lay in ("paged", "flash") for mis in (False, True)
              if not (mis and dt == F32 and lay == "flash")]


def _prepare_copy(c: CopyCase, root):
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    layers, nb, kvh, d, bs = 3, 12, 2, 64, 16
    x = elem_x(c.dtype)
    if c.flash:
        shape_k = shape_v = (nb, bs, kvh, d)
    else:
        shape_k, shape_v = (nb, kvh, d // x, bs, x), (nb, kvh, d, bs)
    kcs = [torch.randn(shape_k, generator=g).to(c.dtype) for _ in range(layers)]
    vcs = [torch.randn(shape_v, generator=g).to(c.dtype) for _ in range(layers)]
    kcs[1][5] = float("nan")
    # Block 2 to two destinations; 5 -> 0; 11 -> 7; pairs naming blocks outside the pool
    # (an unvalidated mapping) are skipped.
    mapping = torch.tensor([[2, 9], [2, 3], [5, 0], [11, 7], [nb, 1], [4, -1]],
                           dtype=torch.long)
    want_k = [k.clone() for k in kcs]
    want_v = [v.clone() for v in vcs]
    for src, dst in mapping.tolist():
        if 0 <= src < nb and 0 <= dst < nb:
            for w, orig in zip(want_k + want_v, kcs + vcs):
                w[dst] = orig[src]
    cd = case_dir(root, c.id)
    cd.set(op="copy_blocks", layers=layers, num_blocks=nb, pairs=mapping.shape[0])
    shift = 2 if c.misaligned else 0  # 2 bytes off: copy_blocks takes its byte path
    for i in range(layers):
        cd.buf(f"key_cache{i}", kcs[i], offset=shift, out=True)
        cd.buf(f"value_cache{i}", vcs[i], offset=shift, out=True)
    cd.buf("mapping", mapping)
    cd.write()
    return cd, (kcs, vcs, want_k, want_v)


# (mapping, copies the launcher makes: pairs consecutive on both sides are one copy)
SWAP_CASES = {
    "swap": ([[0, 6], [9, 0], [3, 3], [3, 4]], 4),
    "swap_runs": ([[0, 2], [1, 3], [2, 4], [7, 0], [8, 1], [5, 6], [9, 5]], 4),
}


def _prepare_swap(root, name):
    g = torch.Generator().manual_seed(31)
    src = torch.randn(10, 2, 64, 16, generator=g).to(F16)
    dst = torch.randn(7, 2, 64, 16, generator=g).to(F16)
    pairs, copies = SWAP_CASES[name]
    mapping = torch.tensor(pairs, dtype=torch.long)
    want = dst.clone()
    for s, t in mapping.tolist():
        want[t] = src[s]
    cd = case_dir(root, name)
    cd.set(op="swap_blocks", pairs=len(pairs), block_bytes=src[0].numel() * 2,
           expect_copies=copies)
    cd.buf("src", src, out=True)
    cd.buf("dst", dst, out=True)
    cd.buf("mapping", mapping)
    cd.write()
    return cd, (src, want)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    want = harness.selected(request, "case") | harness.selected(request, "name")
    root = tmp_path_factory.mktemp("emu_cache")
    prepared = {c.id: _prepare_write(c, root) for c in WRITE_CASES if c.id in want}
    prepared.update({c.id: _prepare_copy(c, root) for c in COPY_CASES if c.id in want})
    prepared.update({name: _prepare_swap(root, name) for name in SWAP_CASES if name in want})
    results = harness.run_cases([cd.path for cd, _ in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


def _check_written(actual, expected, exact, dtype, what):
    if exact:
        assert_bitwise_equal(actual, expected, what)
        return
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: written/untouched slots differ"
    m = ~expected.isnan()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(actual[m].double(), expected[m].double(), atol=1e-30, rtol=eps,
                               msg=lambda s: f"{what}: {s}")


SEED_PARAM = pytest.mark.parametrize("seed", harness.seed_params())


@SEED_PARAM
@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_reshape_and_cache_emulated(runs, case, seed):
    prepared, results = runs
    cd, (ks, vs, kc, vc, want_k, want_v) = prepared[case.id]
    res = results[cd.path]
    assert res.ok, res.message
    exact = all(s in (1.0, 0.5, 2.0, 4.0, 0.25) for s in (case.k_scale, case.v_scale))
    _check_written(cd.read("key_cache", seed, kc), want_k, exact, case.dtype, "key_cache")
    _check_written(cd.read("value_cache", seed, vc), want_v, exact, case.dtype, "value_cache")
    assert_bitwise_equal(cd.read("key_storage", seed, ks), ks, "key must not be modified")
    assert_bitwise_equal(cd.read("value_storage", seed, vs), vs, "value must not be modified")


@SEED_PARAM
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.id)
def test_copy_blocks_emulated(runs, case, seed):
    prepared, results = runs
    cd, (kcs, vcs, want_k, want_v) = prepared[case.id]
    res = results[cd.path]
    assert res.ok, res.message
    for i in range(len(kcs)):
        assert_bitwise_equal(cd.read(f"key_cache{i}", seed, kcs[i]), want_k[i], f"key layer {i}")
        assert_bitwise_equal(cd.read(f"value_cache{i}", seed, vcs[i]), want_v[i],
                             f"value layer {i}")


@SEED_PARAM
@pytest.mark.parametrize("name", list(SWAP_CASES))
def test_swap_blocks_emulated(runs, name, seed):
    prepared, results = runs
    cd, (src, want) = prepared[name]
    res = results[cd.path]
    assert res.ok, res.message
    assert_bitwise_equal(cd.read("dst", seed, want), want, "dst")
    assert_bitwise_equal(cd.read("src", seed, src), src, "src must not be modified")
