"""fp8 KV caches (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2": uint8 caches, key chunk x = 16)
in the CUDA kernels of csrc/cuda, run on the CPU by the SIMT emulator (with ASan):

- reshape_and_cache(_flash) writes key / k_scale and value / v_scale bit for bit as torch's
  float8_e4m3fn / float8_e5m2 casts of the float32 quotient: a sweep of float32 values over
  both formats' conversion paths (subnormals, ties, overflow, inf, NaN) and random writes
  (both layouts, every model dtype, scales != 1, padding and out-of-pool slots, fused and
  misaligned inputs) into NaN-byte caches, which must keep every other byte;
- paged_attention v1 / v2 and varlen_paged_attention read fp8 caches: against the float64
  reference on the dequantized cache (stored value x scale) with the usual tolerances of
  the query dtype; every slot no sequence reads is a NaN byte; block sizes 8 / 16 / 32
  (a value row of a block of 8 is 8 bytes: a 16-byte read would run past it, and past the
  cache for the last block, which ASan catches), head sizes 16 .. 256, GQA / MQA / MHA;
- copy_blocks moves uint8 blocks bit for bit (16-byte and byte paths).

Each case runs under every schedule seed of harness.seeds() (the first
by default, the others with --full-grid); each (case, seed) is a test.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

from ops.reference import (  # tests/ is on sys.path (rootdir-based packages)
    FP8_DTYPES,
    assert_bitwise_equal,
    assert_close,
    dtype_name,
    fp8_bytes,
    make_paged_kv,
    num_partitions,
    ref_paged_attention,
    ref_reshape_and_cache,
    ref_varlen_paged_attention,
    to_fp8_caches,
)
from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CODE = {F32: "f32", F16: "f16", BF16: "bf16"}
FP8 = {f: FP8_DTYPES[f] for f in ("fp8_e4m3", "fp8_e5m2")}
FORMATS = list(FP8)
NAN_BYTE = 0x7F  # NaN in both formats


def interesting_floats() -> torch.Tensor:
    """float32 values over both formats' conversion paths: a stride through every bit
    pattern, every fp8 value and midpoint with their float32 neighbours, and edge cases."""
    parts = [torch.arange(0, 2**32, 65537 * 3, dtype=torch.int64).to(torch.int32)
             .view(torch.float32)]
    for fp8 in FP8.values():
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        v = v[torch.isfinite(v)].unique()
        for t in (v, (v[1:] + v[:-1]) / 2):
            b = t.view(torch.int32)
            for d in (-1, 0, 1):
                parts.append((b + d).view(torch.float32))
    parts.append(torch.tensor([0.0, 448.0, 463.99, 464.0, 480.0, 57344.0, 61439.0, 61440.0,
                               65536.0, 1e30, float("inf"), float("nan"), 2.0**-9, 2.0**-10,
                               3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18, 1e-45]))
    x = torch.cat(parts)
    return torch.cat([x, -x])


# ---------------------------------------------------------------------------------------
# reshape_and_cache(_flash)


@dataclass(frozen=True)
class WriteCase:
    id: str
    flash: bool
    dtype: torch.dtype
    fmt: str
    kvh: int
    d: int
    bs: int
    k_scale: float
    v_scale: float
    kind: str  # contiguous | fused_qkv | misaligned | sweep
    n: int


def _write_cases() -> list[WriteCase]:
    rng = random.Random(11)
    cases = []
    # The conversion sweep: float32 through the flash layout, with scale 1 and with scales
    # whose reciprocals are inexact; the values are scaled by them first, so that many
    # quotients fall exactly on fp8 ties (value * (1 / scale) would miss them by an ulp and
    # round the other way).
    n = (interesting_floats().numel() + 63) // 64
    for fmt in FORMATS:
        for ks, vs in ((1.0, 1.0), (30.0, 0.6)):
            cases.append(WriteCase(f"sweep-{fmt}-s{ks}_{vs}", True, F32, fmt, 1, 64, 16, ks, vs,
                                   "sweep", n))
    i = 0
    for flash in (False, True):
        for dt in (F32, F16, BF16):
            for fmt in FORMATS:
                # The paged layout's fp8 key chunk is 16 elements: head sizes 40 / 72 only
                # in the flash layout.
                kvh, d = ([(2, 80), (1, 40), (4, 128), (2, 72), (1, 16), (3, 64)] if flash else
                          [(1, 64), (2, 80), (4, 128), (2, 256), (1, 16), (3, 48)])[i % 6]
                bs = (8, 16, 32)[i % 3]
                ks, vs = [(1.0, 1.0), (0.37, 2.5), (1e-3, 30.0), (2.0, 0.25)][i % 4]
                kind = ("contiguous", "fused_qkv", "misaligned")[(i // 2) % 3]
                n = rng.choice([1, 5, 13, 40])
                cases.append(WriteCase(
                    f"{'flash' if flash else 'paged'}-{dtype_name(dt)}-{fmt}-k{kvh}-d{d}-b{bs}"
                    f"-s{ks}_{vs}-{kind}-n{n}", flash, dt, fmt, kvh, d, bs, ks, vs, kind, n))
                i += 1
    return cases


WRITE_CASES = _write_cases()


def _prepare_write(c: WriteCase, root):
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    nb = (c.n + c.bs - 1) // c.bs + 2
    if c.kind == "sweep":
        x = interesting_floats()
        x = torch.cat([x, torch.zeros(c.n * c.d - x.numel())]).view(c.n, 1, c.d)
        key, value = x * c.k_scale, -x * c.v_scale  # float32 products
    elif c.kind == "fused_qkv":
        h = 4
        qkv = torch.randn(c.n, (h + 2 * c.kvh) * c.d, generator=g)
        qkv = (qkv * torch.exp2(torch.randint(-12, 10, qkv.shape, generator=g))).to(c.dtype)
        key = qkv[:, h * c.d:(h + c.kvh) * c.d].view(c.n, c.kvh, c.d)
        value = qkv[:, (h + c.kvh) * c.d:].view(c.n, c.kvh, c.d)
    else:
        # Values over many binades: subnormal to overflowing after the scale.
        key = (torch.randn(c.n, c.kvh, c.d, generator=g)
               * torch.exp2(torch.randint(-12, 10, (c.n, c.kvh, c.d), generator=g))).to(c.dtype)
        value = (torch.randn(c.n, c.kvh, c.d, generator=g) * 4).to(c.dtype)
    slots = torch.randperm(nb * c.bs, generator=g)[: c.n]
    if c.kind != "sweep":
        pad = torch.randperm(c.n, generator=g)[: c.n // 3]
        bad = [-1, -7, -(2**40), nb * c.bs, 2**40]
        slots[pad] = torch.tensor([bad[j % len(bad)] for j in range(len(pad))],
                                  dtype=torch.long)
    if c.flash:
        shape_k = shape_v = (nb, c.bs, c.kvh, c.d)
    else:
        shape_k, shape_v = (nb, c.kvh, c.d // 16, c.bs, 16), (nb, c.kvh, c.d, c.bs)
    kc = torch.full(shape_k, NAN_BYTE, dtype=torch.uint8)
    vc = torch.full(shape_v, NAN_BYTE, dtype=torch.uint8)
    valid = slots.clone()
    valid[(valid < 0) | (valid >= nb * c.bs)] = -1  # the reference skips negative slots
    # torch's bytes, placed by the shared reference (scale 1 there: the bytes are final).
    want_k, want_v = ref_reshape_and_cache(fp8_bytes(key, c.fmt, c.k_scale),
                                           fp8_bytes(value, c.fmt, c.v_scale), kc, vc, valid,
                                           flash=c.flash)
    ks, k_off = harness.storage_of(key)
    vs, v_off = harness.storage_of(value)
    shift = key.element_size() if c.kind == "misaligned" else 0
    cd = case_dir(root, c.id)
    cd.set(op="reshape_and_cache", dtype=CODE[c.dtype], kv=c.fmt, flash=int(c.flash),
           num_tokens=c.n, num_kv_heads=c.kvh, head_size=c.d, block_size=c.bs, num_blocks=nb,
           key_stride=key.stride(0), value_stride=value.stride(0), k_scale=c.k_scale,
           v_scale=c.v_scale, key_offset=k_off, value_offset=v_off)
    cd.buf("key_storage", ks, offset=shift, out=True)
    cd.buf("value_storage", vs, offset=shift, out=True)
    cd.buf("key_cache", kc, out=True)
    cd.buf("value_cache", vc, out=True)
    cd.buf("slot_mapping", slots)
    cd.write()
    return cd, (ks, vs, kc, vc, want_k, want_v)


# ---------------------------------------------------------------------------------------
# paged_attention v1 / v2 and varlen


@dataclass(frozen=True)
class AttnCase:
    id: str
    fmt: str
    dtype: torch.dtype
    lens: tuple[int, ...]
    news: tuple[int, ...] | None  # varlen: query rows per sequence; None: decode (v1/v2)
    kvh: int
    group: int
    d: int
    bs: int
    k_scale: float
    v_scale: float


def _attn_cases() -> list[AttnCase]:
    shapes = [(2, 4, 64), (1, 8, 128), (3, 1, 80), (2, 2, 256), (1, 2, 16), (2, 3, 48)]
    scales = [(0.05, 0.5), (2.0, 0.25), (1.0, 1.0)]
    decode_lens = [(1, 17, 300), (700, 5), (64,), (513, 0, 33), (9, 8), (250, 1)]
    varlen = [((40, 300), (40, 3)), ((17, 1, 64), (17, 1, 20)), ((130,), (50,)),
              ((9, 0, 33), (9, 0, 1)), ((200, 24), (1, 24)), ((65, 8), (65, 8))]
    cases, i = [], 0
    for fmt in FORMATS:
        for dt in (F32, F16, BF16):
            for bs in (8, 16, 32):
                kvh, group, d = shapes[i % len(shapes)]
                ks, vs = scales[i % len(scales)]
                lens = decode_lens[i % len(decode_lens)]
                cases.append(AttnCase(
                    f"decode-{fmt}-{dtype_name(dt)}-L{'_'.join(map(str, lens))}-k{kvh}g{group}"
                    f"-d{d}-b{bs}-s{ks}_{vs}", fmt, dt, lens, None, kvh, group, d, bs, ks, vs))
                lens, news = varlen[(i + 1) % len(varlen)]
                kvh, group, d = shapes[(i + 2) % len(shapes)]
                cases.append(AttnCase(
                    f"varlen-{fmt}-{dtype_name(dt)}-L{'_'.join(map(str, lens))}"
                    f"-n{'_'.join(map(str, news))}-k{kvh}g{group}-d{d}-b{bs}-s{ks}_{vs}",
                    fmt, dt, lens, news, kvh, group, d, bs, ks, vs))
                i += 1
    # One query head per CTA (MHA: the K pass keeps q in registers) for every block size
    # and head-size bucket; fp8 value rows at block size 8 are 8 bytes.
    for j, (bs, d) in enumerate([(8, 48), (8, 112), (8, 176), (16, 64), (16, 80), (16, 256),
                                 (32, 16), (32, 128), (32, 208)]):
        fmt, dt = FORMATS[j % 2], (F32, F16, BF16)[j % 3]
        ks, vs = scales[j % len(scales)]
        lens = (bs - 1, 530)
        cases.append(AttnCase(
            f"decode-mha-{fmt}-{dtype_name(dt)}-L{'_'.join(map(str, lens))}-k2g1-d{d}-b{bs}"
            f"-s{ks}_{vs}", fmt, dt, lens, None, 2, 1, d, bs, ks, vs))
    return cases


ATTN_CASES = _attn_cases()


def _prepare_attn(c: AttnCase, root):
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    cols = max(1, math.ceil(max(c.lens) / c.bs))
    kv = make_paged_kv(list(c.lens), c.kvh, c.d, c.bs, torch.float32, "cpu", g, table_cols=cols)
    k8, v8, kd, vd = to_fp8_caches(kv, c.fmt, c.k_scale, c.v_scale)
    h = c.kvh * c.group
    rows = len(c.lens) if c.news is None else sum(c.news)
    query = torch.randn(rows, h, c.d, generator=g).to(c.dtype)
    scale = 1.0 / math.sqrt(c.d)
    out = torch.full((rows, h, c.d), float("nan"), dtype=c.dtype)
    cd = case_dir(root, c.id)
    common = dict(dtype=CODE[c.dtype], kv=c.fmt, num_seqs=len(c.lens), num_heads=h,
                  num_kv_heads=c.kvh, head_size=c.d, block_size=c.bs, num_blocks=k8.shape[0],
                  max_blocks_per_seq=cols, q_stride_seq=query.stride(0),
                  q_stride_head=query.stride(1), q_offset=0, scale=scale, k_scale=c.k_scale,
                  v_scale=c.v_scale)
    if c.news is None:
        p = num_partitions(max(c.lens))
        exp_sums = torch.full((rows, h, p), float("nan"), dtype=torch.float32)
        cd.set(op="attention", max_seq_len=max(c.lens), sms=1, num_partitions=p, **common)
        cd.buf("out_v1", out, out=True)
        cd.buf("out_v2", out, out=True)
        cd.buf("exp_sums", exp_sums)
        cd.buf("max_logits", exp_sums)
        cd.buf("tmp_out", torch.full((rows, h, p, c.d), float("nan"), dtype=c.dtype))
        want, _ = ref_paged_attention(query, kd, vd, c.kvh, scale, kv.block_tables, kv.seq_lens,
                                      c.bs)
    else:
        qsl = torch.tensor([0, *c.news], dtype=torch.int32).cumsum(0).to(torch.int32)
        cd.set(op="varlen", num_tokens=rows, max_query_len=max(c.news), **common)
        cd.buf("query_start_loc", qsl)
        cd.buf("out", out, out=True)
        want = ref_varlen_paged_attention(query, kd, vd, c.kvh, scale, kv.block_tables,
                                          kv.seq_lens, qsl, c.bs)
    cd.buf("query_storage", query)
    cd.buf("key_cache", k8, out=True)
    cd.buf("value_cache", v8, out=True)
    cd.buf("block_tables", kv.block_tables)
    cd.buf("seq_lens", kv.seq_lens)
    cd.write()
    return cd, (k8, v8, out, want)


# ---------------------------------------------------------------------------------------
# copy_blocks on uint8 caches


COPY_CASES = ["copy-fp8-paged", "copy-fp8-misaligned"]


def _prepare_copy(name: str, root):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    layers, nb, kvh, d, bs = 2, 9, 2, 48, 8
    kcs = [torch.randint(0, 256, (nb, kvh, d // 16, bs, 16), dtype=torch.uint8, generator=g)
           for _ in range(layers)]
    vcs = [torch.randint(0, 256, (nb, kvh, d, bs), dtype=torch.uint8, generator=g)
           for _ in range(layers)]
    mapping = torch.tensor([[2, 7], [2, 3], [5, 0], [8, 6], [nb, 1], [4, -1]], dtype=torch.long)
    want_k, want_v = [k.clone() for k in kcs], [v.clone() for v in vcs]
    for src, dst in mapping.tolist():
        if 0 <= src < nb and 0 <= dst < nb:
            for w, orig in zip(want_k + want_v, kcs + vcs):
                w[dst] = orig[src]
    cd = case_dir(root, name)
    cd.set(op="copy_blocks", layers=layers, num_blocks=nb, pairs=mapping.shape[0])
    shift = 1 if name.endswith("misaligned") else 0  # one byte off: the byte path
    for i in range(layers):
        cd.buf(f"key_cache{i}", kcs[i], offset=shift, out=True)
        cd.buf(f"value_cache{i}", vcs[i], offset=shift, out=True)
    cd.buf("mapping", mapping)
    cd.write()
    return cd, (kcs, vcs, want_k, want_v)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case prepared and run (its selected seeds) in one emulator process."""
    want = harness.selected(request, "case") | harness.selected(request, "name")
    root = tmp_path_factory.mktemp("emu_fp8")
    prepared = {c.id: _prepare_write(c, root) for c in WRITE_CASES if c.id in want}
    prepared.update({c.id: _prepare_attn(c, root) for c in ATTN_CASES if c.id in want})
    prepared.update({name: _prepare_copy(name, root) for name in COPY_CASES if name in want})
    results = harness.run_cases([cd.path for cd, _ in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


SEED_PARAM = pytest.mark.parametrize("seed", harness.seed_params())


def _first_diff(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: got "
        f"{int(got[tuple(bad[0])]):#04x}, want {int(want[tuple(bad[0])]):#04x}")


@SEED_PARAM
@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_reshape_and_cache_fp8_emulated(runs, case, seed):
    prepared, results = runs
    cd, (ks, vs, kc, vc, want_k, want_v) = prepared[case.id]
    res = results[cd.path]
    assert res.ok, res.message
    _first_diff(cd.read("key_cache", seed, kc), want_k, "key_cache")
    _first_diff(cd.read("value_cache", seed, vc), want_v, "value_cache")
    assert_bitwise_equal(cd.read("key_storage", seed, ks), ks, "key must not be modified")
    assert_bitwise_equal(cd.read("value_storage", seed, vs), vs, "value must not be modified")


@SEED_PARAM
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
def test_attention_fp8_emulated(runs, case, seed):
    prepared, results = runs
    cd, (k8, v8, out, want) = prepared[case.id]
    res = results[cd.path]
    assert res.ok, res.message
    # Unused slots are NaN bytes: the kernels must never let one into the output.
    assert (k8 == NAN_BYTE).any() or all(n % case.bs == 0 for n in case.lens)
    names = ["out"] if case.news is not None else ["out_v1", "out_v2"]
    for name in names:
        assert_close(cd.read(name, seed, out), want, case.dtype, name)
    assert_bitwise_equal(cd.read("key_cache", seed, k8), k8, "key_cache must not be modified")
    assert_bitwise_equal(cd.read("value_cache", seed, v8), v8,
                         "value_cache must not be modified")


@SEED_PARAM
@pytest.mark.parametrize("name", COPY_CASES)
def test_copy_blocks_fp8_emulated(runs, name, seed):
    prepared, results = runs
    cd, (kcs, vcs, want_k, want_v) = prepared[name]
    res = results[cd.path]
    assert res.ok, res.message
    for i in range(len(kcs)):
        assert_bitwise_equal(cd.read(f"key_cache{i}", seed, kcs[i]), want_k[i], f"key layer {i}")
        assert_bitwise_equal(cd.read(f"value_cache{i}", seed, vcs[i]), want_v[i],
                             f"value layer {i}")
