"""paged_attention_v1 / v2 (+ the v2 reduce kernel) of csrc/cuda, run on the CPU by the
SIMT emulator, against the float64 reference of tests/ops/reference.py with the CUDA
tests' tolerances.

As in tests/ops/test_attention.py: every cache slot no sequence reads is NaN, outputs
and the v2 scratch start as NaN, partitions a sequence does not have must stay NaN bit for
bit, v1 == v2 within tolerance, and the inputs must be unchanged. Sizes are reduced (the
emulator runs each GPU thread as a fiber under ASan). Every case runs under each schedule
seed of harness.seeds() (two random schedules: the first by default, the second with
--full-grid); each (case, seed) is a test.

The tensor-core decode kernel (cases planned for sm_90) runs every case of the SIMT
kernel it takes, and a grid of its own (TC_GRID: caches in the query dtype and fp8 e4m3 /
e5m2 with scales != 1, split and flash layouts, GQA 3 / 4 / 8, head sizes 64 / 128, block
sizes 8 / 16 / 32), a representative part by default and the rest with --full-grid. Each
case also checks which kernel the launcher took (test_decode_path_choice states the rule).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import zlib
from dataclasses import dataclass

import numpy as np

import pytest
import torch

from ops.reference import (  # tests/ is on sys.path (rootdir-based packages)
    PARTITION_SIZE,
    alibi_slopes,
    assert_bitwise_equal,
    assert_close,
    dtype_name,
    make_paged_kv,
    nan_like,
    num_partitions,
    ref_paged_attention,
    split_to_flash,
    to_fp8_caches,
)
from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CODE = {F32: "f32", F16: "f16", BF16: "bf16"}
FP8_NAN_BYTE = 0x7F  # NaN in both fp8 formats


@dataclass(frozen=True)
class Case:
    id: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]
    alibi: bool = False
    max_seq_len: int | None = None  # default: max(seq_lens)
    extra_partitions: int = 0
    table_extra_cols: int = 1
    table_fill: str = "nan_block"
    query: str = "contiguous"  # or fused_qkv, head_stride, seq_step
    sms: int = 132  # 1: the launcher keeps up to 8 heads per CTA
    k_scale: float = 1.0
    v_scale: float = 1.0
    corrupt: int = 0  # table entries inside the lengths replaced by ids outside the pool
    flash: bool = False  # the caches in the flash layout (split_to_flash of the same values)
    cc: int = 75  # compute capability the launcher plans for (80+: the tensor-core kernel)
    kv: str = "auto"  # kv_cache_dtype: auto (caches in dtype), fp8_e4m3, fp8_e5m2

    @property
    def msl(self) -> int:
        return max(self.seq_lens, default=0) if self.max_seq_len is None else self.max_seq_len


def _cases() -> list[Case]:
    cases = []
    # Context lengths 1, block - 1, block, block + 1, and over several partitions, per
    # block size and dtype; GQA 4:1 with up to 8 heads per CTA (sms=1).
    for bs, dt, hs, alibi in ((8, F32, 64, False), (16, F16, 128, True), (32, BF16, 80, False),
                              (16, BF16, 256, True), (8, F16, 40, True), (32, F32, 128, True)):
        lens = (1, bs - 1, bs, bs + 1, PARTITION_SIZE + 3)
        cases.append(Case(f"lens-b{bs}-{dtype_name(dt)}-d{hs}{'-alibi' if alibi else ''}",
                          dt, 8, 2, hs, bs, lens, alibi=alibi, sms=1))
    # Head sizes x dtypes x block sizes, MQA / GQA / MHA, ALiBi, empty sequences.
    rng = random.Random(13)
    heads = [(4, 4), (8, 2), (6, 1), (16, 1), (3, 3)]
    sizes = [64, 80, 128, 256, 40, 8, 72]
    i = 0
    for dt in (F32, F16, BF16):
        for k in range(5):
            h, kvh = heads[(i + k) % len(heads)]
            hs = sizes[i % len(sizes)]
            bs = (8, 16, 32)[i % 3]
            s = rng.choice([1, 2, 3])
            lens = tuple(rng.randint(1, 300) for _ in range(s))
            if k == 4:
                lens = lens + (0,)  # an empty sequence
            cases.append(Case(f"grid{i:02d}-{dtype_name(dt)}-h{h}k{kvh}-d{hs}-b{bs}-s{len(lens)}",
                              dt, h, kvh, hs, bs, lens, alibi=i % 2 == 1,
                              max_seq_len=max(lens) + (37 if i % 4 == 2 else 0),
                              extra_partitions=int(i % 5 == 3), sms=(1, 132)[i % 2]))
            i += 1
    # v2 with several partitions (3 and 2) and a 64:1 group split over CTAs.
    cases.append(Case("multi-part-f32-mqa", F32, 4, 1, 64, 16, (1100, 600, 20), alibi=True))
    cases.append(Case("multi-part-bf16-64to1", BF16, 64, 1, 64, 32, (700, 5), sms=1))
    # Strided query rows (views of a bigger tensor).
    for kind, dt in (("fused_qkv", F16), ("head_stride", BF16), ("seq_step", F32)):
        cases.append(Case(f"strided-{kind}-{dtype_name(dt)}", dt, 8, 2, 64, 16, (37, 530, 1),
                          alibi=kind == "seq_step", query=kind))
    # Table columns past a sequence's end hold garbage ids; kv scales.
    cases.append(Case("garbage-table-bf16", BF16, 8, 1, 128, 16, (1, 17, 300),
                      table_extra_cols=4, table_fill="garbage"))
    cases.append(Case("scales-f16", F16, 8, 2, 80, 8, (50, 520), alibi=True, k_scale=0.5,
                      v_scale=2.0))
    cases.append(Case("all-empty-f16", F16, 4, 4, 32, 16, (0, 0), max_seq_len=0))
    # A CUDA-graph decode launch: the bound is the model's length, partitions past every
    # sequence's, a table as wide as that bound (NaN blocks past each length), and rows
    # padded to the batch bucket with one token each (v1 with one head group, v2 split).
    for dt, parts, sms in ((BF16, 0, 1), (F16, 2, 132)):
        cases.append(Case(f"graph-bounds-{dtype_name(dt)}-p{parts}", dt, 8, 2, 64, 16,
                          (300, 1, 17, 1, 1), max_seq_len=3 * PARTITION_SIZE + 40,
                          extra_partitions=parts, sms=sms))
    # One query head per CTA (MHA: heads_per_cta == 1, the K pass keeps q in registers) for
    # every block size and head-size bucket, with head sizes that leave the last 32-row
    # group of the V pass partly empty; lengths end inside a block and cross a chunk.
    dts = (F32, F16, BF16)
    for i, (bs, hs) in enumerate([(8, 24), (8, 104), (8, 256), (16, 64), (16, 72), (16, 232),
                                  (32, 40), (32, 128), (32, 136)]):
        dt = dts[i % 3]
        cases.append(Case(f"mha-{dtype_name(dt)}-d{hs}-b{bs}", dt, 2, 2, hs, bs,
                          (bs - 1, PARTITION_SIZE + 18, 3), alibi=i % 2 == 0))
    # Block ids outside the pool inside a sequence's length: those blocks read as zeros
    # (one head per CTA and 4 per CTA).
    cases.append(Case("corrupt-ids-mha-f32", F32, 2, 2, 48, 16, (100, 530), corrupt=3))
    cases.append(Case("corrupt-ids-gqa-bf16", BF16, 8, 2, 128, 32, (200, 70), corrupt=3,
                      sms=1))
    # The flash layout: every block size and dtype, one head and several per CTA, a head
    # size with a partly empty value row group, several partitions, corrupt ids.
    cases.append(Case("flash-lens-b8-f32-d64", F32, 8, 2, 64, 8, (1, 7, 8, 9, PARTITION_SIZE + 3),
                      sms=1, flash=True))
    cases.append(Case("flash-gqa-b16-f16-d128-alibi", F16, 8, 2, 128, 16, (1, 300, 17, 0),
                      alibi=True, flash=True))
    cases.append(Case("flash-mha-b32-bf16-d72", BF16, 2, 2, 72, 32, (31, PARTITION_SIZE + 18, 3),
                      flash=True))
    cases.append(Case("flash-multi-part-bf16-64to1", BF16, 64, 1, 64, 32, (700, 5), sms=1,
                      flash=True))
    cases.append(Case("flash-corrupt-ids-mha-f32", F32, 2, 2, 48, 16, (100, 530), corrupt=3,
                      flash=True))
    # The GQA shapes of the tensor-core kernel: 7 heads of a group (rows 7..15 of the MMA
    # tile are padding), the default model's 9/3 x 64, lengths ending inside a stage and
    # crossing partitions.
    cases.append(Case("gqa7-bf16-28x4-d128", BF16, 28, 4, 128, 16, (1, 31, 33, 530),
                      alibi=True))
    cases.append(Case("gqa3-f16-9x3-d64", F16, 9, 3, 64, 16, (16, 63, 65, 1100)))
    cases.append(Case("gqa2-bf16-4x2-d64", BF16, 4, 2, 64, 8, (7, 130), v_scale=0.5,
                      k_scale=2.0))
    # Every case the tensor-core kernel takes once more as on an sm_90 GPU.
    cases += [dataclasses.replace(c, id=f"{c.id}-sm90", cc=90) for c in cases
              if takes_tensor_cores(90, c.dtype, c.num_heads // c.num_kv_heads, c.head_size)]
    # fp8 caches on the SIMT kernel (sm_75) next to the same shapes on tensor cores.
    cases.append(Case("fp8-e4m3-gqa3-bf16-9x3-d64-sm75", BF16, 9, 3, 64, 16, (77, 1, 530),
                      k_scale=0.05, v_scale=0.5, kv="fp8_e4m3"))
    cases.append(Case("fp8-e5m2-flash-gqa4-f16-8x2-d128-sm75", F16, 8, 2, 128, 8, (77, 530),
                      k_scale=2.0, v_scale=0.25, kv="fp8_e5m2", flash=True))
    return cases


# The tensor-core kernel's grid: cache element x layout x (heads, kv heads, head size) for
# GQA 3 (the default model's 9/3 x 64), 4 and 8 x block size, on sm_90; the query dtype
# alternates. Lengths end inside a block and a stage and cross a partition (v1 and v2 both
# run). The default set covers every value of every axis; the rest is the full grid.
TC_SHAPES = ((9, 3, 64), (6, 2, 128), (8, 2, 64), (4, 1, 128), (8, 1, 64), (16, 2, 128))
TC_KV = ("auto", "fp8_e4m3", "fp8_e5m2")
TC_SCALES = ((0.05, 0.5), (2.0, 0.25), (0.37, 1.5))
TC_LENS = ((77, 1, 530), (530, 17), (33, 0, 515), (1, 100, 45))
TC_DEFAULT = {  # (kv, flash, shape index, block size)
    ("fp8_e4m3", False, 0, 16), ("fp8_e5m2", True, 0, 16), ("fp8_e4m3", True, 5, 8),
    ("fp8_e5m2", False, 3, 8), ("fp8_e4m3", False, 4, 32), ("auto", True, 2, 32),
    ("fp8_e5m2", True, 1, 32), ("auto", True, 1, 8), ("fp8_e4m3", True, 3, 16),
}


def _tc_grid() -> list:
    params = []
    for i, (kv, flash, si, bs) in enumerate(itertools.product(
            TC_KV, (False, True), range(len(TC_SHAPES)), (8, 16, 32))):
        h, kvh, d = TC_SHAPES[si]
        dt = (F16, BF16)[i % 2]
        ks, vs = TC_SCALES[i % len(TC_SCALES)]
        lens = TC_LENS[i % len(TC_LENS)]
        c = Case(f"tc-{kv}-{'flash' if flash else 'split'}-g{h // kvh}-{h}x{kvh}-d{d}-b{bs}-"
                 f"{dtype_name(dt)}", dt, h, kvh, d, bs, lens, k_scale=ks, v_scale=vs,
                 flash=flash, cc=90, kv=kv, alibi=i % 5 == 0)
        default = (kv, flash, si, bs) in TC_DEFAULT
        params.append(pytest.param(c, id=c.id, marks=() if default else pytest.mark.full_grid))
    return params


def takes_tensor_cores(cc: int, dtype: torch.dtype, group: int, head_size: int) -> bool:
    """The launcher's kernel choice (csrc/cuda/attention/attention_path.h), stated here
    independently: the tensor-core decode kernel on sm_80 and newer for 16-bit queries,
    GQA/MQA groups of >= 2 heads and head sizes 64 and 128, whatever the cache element
    (the query dtype, fp8 e4m3 / e5m2) and layout (split, flash)."""
    return cc >= 80 and dtype in (F16, BF16) and group >= 2 and head_size in (64, 128)


TC_GRID = _tc_grid()
_BASE = _cases()
CASES = _BASE + [p.values[0] for p in TC_GRID]
PARAMS = [pytest.param(c, id=c.id) for c in _BASE] + TC_GRID


@dataclass
class Prepared:
    case: Case
    dir: harness.CaseDir
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slopes: torch.Tensor | None
    scale: float
    storage: torch.Tensor
    out: torch.Tensor  # NaN templates (shape/dtype of the outputs)
    exp_sums: torch.Tensor
    tmp_out: torch.Tensor
    ref_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the reference's K, V, table


def _query(c: Case, g: torch.Generator) -> torch.Tensor:
    s, h, d = len(c.seq_lens), c.num_heads, c.head_size
    if c.query == "contiguous":
        return torch.randn(s, h, d, generator=g).to(c.dtype)
    if c.query == "fused_qkv":
        big = torch.randn(s, (h + 2 * c.num_kv_heads) * d, generator=g).to(c.dtype)
        return big[:, : h * d].view(s, h, d)
    if c.query == "head_stride":
        return torch.randn(s, h, 2 * d, generator=g).to(c.dtype)[:, :, d:]
    return torch.randn(2 * s, h, d, generator=g).to(c.dtype)[::2]


def prepare(c: Case, root) -> Prepared:
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    cols = max(1, math.ceil(c.msl / c.block_size)) + c.table_extra_cols
    fp8 = c.kv != "auto"
    kv = make_paged_kv(list(c.seq_lens), c.num_kv_heads, c.head_size, c.block_size,
                       torch.float32 if fp8 else c.dtype, "cpu", g, table_cols=cols,
                       unused_table_fill=c.table_fill)
    query = _query(c, g)
    ref_kv = (kv.key_cache, kv.value_cache, kv.block_tables)
    if fp8:  # uint8 caches of key / k_scale, value / v_scale; the reference reads them x scale
        assert not c.corrupt
        kv.key_cache, kv.value_cache, kd, vd = to_fp8_caches(kv, c.kv, c.k_scale, c.v_scale)
        ref_kv = (kd, vd, kv.block_tables)
        assert (kv.key_cache == FP8_NAN_BYTE).any(), "unused cache slots must be NaN bytes"
    if c.corrupt:
        ref_kv, kv.block_tables = _corrupt_table(c, kv, g)
    if c.flash:  # the kernel reads the same values in the flash layout
        kv.key_cache, kv.value_cache = split_to_flash(kv.key_cache, kv.value_cache)
    slopes = alibi_slopes(c.num_heads) if c.alibi else None
    scale = 1.0 / math.sqrt(c.head_size)
    storage, q_off = harness.storage_of(query)
    s, h, d = query.shape
    p = num_partitions(c.msl) + c.extra_partitions
    out = torch.full((s, h, d), float("nan"), dtype=c.dtype)
    exp_sums = torch.full((s, h, p), float("nan"), dtype=torch.float32)
    tmp_out = torch.full((s, h, p, d), float("nan"), dtype=c.dtype)

    cd = case_dir(root, c.id)
    cd.set(op="attention", dtype=CODE[c.dtype], kv=c.kv, num_seqs=s, num_heads=h,
           num_kv_heads=c.num_kv_heads, head_size=d, block_size=c.block_size,
           num_blocks=kv.key_cache.shape[0], max_blocks_per_seq=cols,
           q_stride_seq=query.stride(0), q_stride_head=query.stride(1), q_offset=q_off,
           max_seq_len=c.msl, sms=c.sms, scale=scale, k_scale=c.k_scale, v_scale=c.v_scale,
           num_partitions=p, flash=int(c.flash), cc=c.cc)
    cd.buf("path", np.full(1, -1, dtype=np.int32), out=True)
    cd.buf("query_storage", storage, out=True)
    cd.buf("key_cache", kv.key_cache, out=True)
    cd.buf("value_cache", kv.value_cache, out=True)
    cd.buf("block_tables", kv.block_tables)
    cd.buf("seq_lens", kv.seq_lens)
    if slopes is not None:
        cd.buf("alibi_slopes", slopes)
    cd.buf("out_v1", out, out=True)
    cd.buf("out_v2", out, out=True)
    cd.buf("exp_sums", exp_sums, out=True)
    cd.buf("max_logits", exp_sums, out=True)
    cd.buf("tmp_out", tmp_out, out=True)
    cd.write()
    return Prepared(c, cd, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                    slopes, scale, storage, out, exp_sums, tmp_out, ref_kv)


def _corrupt_table(c: Case, kv, g: torch.Generator):
    """c.corrupt table entries inside the lengths get ids outside the pool (the kernel
    reads such a block as zeros). Returns the reference's (K, V, table): the caches with
    a zero block appended and the table pointing there instead, and the corrupted table."""
    nb = kv.key_cache.shape[0]
    bad_ids = torch.tensor([-1, nb, 2**31 - 1, -(2**31)], dtype=torch.int32)
    inside = [(s, b) for s, n in enumerate(c.seq_lens) for b in range(math.ceil(n / c.block_size))]
    pick = torch.randperm(len(inside), generator=g)[: c.corrupt].tolist()
    table, ref_table = kv.block_tables.clone(), kv.block_tables.clone()
    for j, i in enumerate(pick):
        s, b = inside[i]
        table[s, b] = bad_ids[j % len(bad_ids)]
        ref_table[s, b] = nb
    zk = torch.zeros_like(kv.key_cache[:1])
    zv = torch.zeros_like(kv.value_cache[:1])
    return (torch.cat([kv.key_cache, zk]), torch.cat([kv.value_cache, zv]), ref_table), table


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case prepared and run (its selected seeds) in one emulator process."""
    want = harness.selected(request, "case") | harness.selected(request, "name")
    root = tmp_path_factory.mktemp("emu_attention")
    prepared = {c.id: prepare(c, root) for c in CASES if c.id in want}
    results = harness.run_cases([p.dir.path for p in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


def _check_v2_scratch(c: Case, stats, exp_sums, max_logits, tmp_out):
    s_, h, p = exp_sums.shape
    used = torch.zeros(s_, p, dtype=torch.bool)
    want_ml = torch.zeros(s_, h, p, dtype=torch.float64)
    want_es = torch.zeros(s_, h, p, dtype=torch.float64)
    want_to = torch.zeros(s_, h, p, tmp_out.shape[-1], dtype=torch.float64)
    for s, ps in enumerate(stats):
        n = ps.max_logits.shape[1]
        used[s, :n] = True
        want_ml[s, :, :n], want_es[s, :, :n], want_to[s, :, :n] = (
            ps.max_logits, ps.exp_sums, ps.tmp_out)

    def sel(t, m):
        return t.transpose(1, 2)[m]

    assert_close(sel(max_logits, used), sel(want_ml, used), c.dtype, "max_logits (used)")
    assert_close(sel(exp_sums, used), sel(want_es, used), c.dtype, "exp_sums (used)")
    assert_close(sel(tmp_out, used), sel(want_to, used), c.dtype, "tmp_out (used)")
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits), ("tmp_out", tmp_out)):
        rest = sel(t, ~used)
        assert_bitwise_equal(rest, nan_like(rest), f"{name}: partitions past a sequence's "
                             f"length (seq_lens {list(c.seq_lens)}) must stay untouched")


@pytest.mark.parametrize("seed", harness.seed_params())
@pytest.mark.parametrize("case", PARAMS)
def test_paged_attention_emulated(runs, case, seed):
    prepared, results = runs
    p = prepared[case.id]
    res = results[p.dir.path]
    assert res.ok, res.message
    d = p.dir
    ref_k, ref_v, ref_table = p.ref_kv
    fp8 = case.kv != "auto"  # the dequantized fp8 caches hold the scales already
    ref, stats = ref_paged_attention(p.query, ref_k, ref_v, case.num_kv_heads, p.scale,
                                     ref_table, p.seq_lens, case.block_size, p.slopes,
                                     1.0 if fp8 else case.k_scale, 1.0 if fp8 else case.v_scale)
    path = int(d.read("path", seed, torch.empty(1, dtype=torch.int32)))
    want_tc = takes_tensor_cores(case.cc, case.dtype, case.num_heads // case.num_kv_heads,
                                 case.head_size)
    assert path == int(want_tc), f"kernel path {path}, expected tensor cores: {want_tc}"
    out1 = d.read("out_v1", seed, p.out)
    out2 = d.read("out_v2", seed, p.out)
    exp_sums = d.read("exp_sums", seed, p.exp_sums)
    max_logits = d.read("max_logits", seed, p.exp_sums)
    tmp_out = d.read("tmp_out", seed, p.tmp_out)
    assert_close(out1, ref, case.dtype, "v1 out")
    assert_close(out2, ref, case.dtype, "v2 out")
    _check_v2_scratch(case, stats, exp_sums, max_logits, tmp_out)
    assert_close(out1, out2, case.dtype, "v1 vs v2")
    for name, t in (("query_storage", p.storage), ("key_cache", p.key_cache),
                    ("value_cache", p.value_cache)):
        assert_bitwise_equal(d.read(name, seed, t), t, f"{name} must not be modified")


def test_decode_path_choice(tmp_path):
    """attention_path.h's decode_path over compute capabilities, query dtypes, group and
    head sizes (boundaries included) against takes_tensor_cores. The cache element and
    layout do not enter the choice; the kernel cases above check that every one of them
    (fp8 e4m3 / e5m2, split / flash) takes the path this predicts."""
    rows, want = [], []
    for cc, (dt, q16), group, hs in itertools.product(
            (70, 75, 79, 80, 86, 89, 90, 100, 120), ((F32, 0), (F16, 1), (BF16, 1)),
            (1, 2, 3, 4, 7, 8, 16, 17, 64), (32, 48, 63, 64, 65, 80, 96, 127, 128, 129, 192, 256)):
        rows.append([cc, q16, group, hs])
        want.append(int(takes_tensor_cores(cc, dt, group, hs)))
    c = case_dir(tmp_path, "decode_path")
    c.set(op="decode_path")
    c.buf("in", np.array(rows, dtype=np.int32))
    c.buf("out", np.full(len(rows), -1, dtype=np.int32), out=True)
    c.write()
    res = harness.run_cases([c.path], [0])[c.path]
    assert res.ok, res.message
    got = c.read("out", 0, torch.empty(len(rows), dtype=torch.int32)).tolist()
    bad = [(r, g, w) for r, g, w in zip(rows, got, want) if g != w]
    assert not bad, f"(cc, 16-bit query, group, head) -> got, want: {bad[:10]}"
    assert 0 < sum(want) < len(want)
