"""varlen_paged_attention of csrc/cuda (varlen_attention_kernels.cuh, launched as
varlen_attention.cu launches it), run on the CPU by the SIMT emulator, against the float64
reference of tests/ops/reference.py with the CUDA tests' tolerances.

Ragged query counts (one token, several, a whole prompt, none) after cached prefixes of 0 to
a few hundred tokens (several KV tiles and block boundaries), each head-size bucket (64,
128, 256, and sizes below a bucket's maximum), MHA / GQA / MQA (groups split over CTAs),
block sizes 8 / 16 / 32, ALiBi, kv scales, strided queries. Every cache slot no sequence
reads is NaN, out starts NaN (every row must be written, no NaN may leak in), and the
inputs must be unchanged. Cases with corrupt metadata (lengths, query_start_loc, block ids
that were not validated) must only run without any access outside the tensors (ASan).
Every case runs under each schedule seed of harness.seeds() (the first
by default, the others with --full-grid); each (case, seed) is a test.

The tensor-core kernel (varlen_attention_tc_kernels.cuh) runs where the launcher plans for
an sm_80 / sm_90 GPU (Case.cc): its own cases (GQA 1 / 3 / 4 / 8, head sizes 64 and 128,
prefixes of 0 tokens, a partial block and several blocks, 1 / 17 / 64 / 130 new tokens,
both cache layouts), and every SIMT case it would take once more as on sm_90 (the corrupt
metadata ones by default, the rest in the full grid). Each case checks the kernel path the
launcher took against takes_tensor_cores.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from ops.reference import (  # tests/ is on sys.path (rootdir-based packages)
    alibi_slopes,
    assert_bitwise_equal,
    assert_close,
    dtype_name,
    make_paged_kv,
    ref_varlen_paged_attention,
    split_to_flash,
)
from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CODE = {F32: "f32", F16: "f16", BF16: "bf16"}


@dataclass(frozen=True)
class Case:
    id: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    # (context length including the new tokens, new tokens) per sequence
    seqs: tuple[tuple[int, int], ...]
    alibi: bool = False
    max_query_len_extra: int = 0  # a grid with more query tiles than any sequence needs
    table_extra_cols: int = 1
    table_fill: str = "nan_block"
    query: str = "contiguous"  # or fused_qkv (rows and heads strided)
    k_scale: float = 1.0
    v_scale: float = 1.0
    corrupt: bool = False  # metadata the launcher did not validate: check only for faults
    flash: bool = False  # the caches in the flash layout (the reference reads them so too)
    cc: int = 75  # compute capability the launcher plans for (80+: the tensor-core kernel)


# (context, new tokens): a whole prompt, a decode row, a chunk after a prefix, an empty
# sequence, a few tokens after a prefix crossing several tiles and blocks.
CASES = [
    Case("gqa-f32-d64-b8", F32, 8, 2, 64, 8, ((37, 37), (300, 1), (129, 20), (0, 0), (65, 3))),
    Case("gqa-f16-d128-b16-alibi", F16, 8, 2, 128, 16, ((150, 70), (1, 1), (260, 1), (48, 33)),
         alibi=True),
    Case("gqa-bf16-d256-b32", BF16, 8, 2, 256, 32, ((90, 40), (200, 3), (16, 16))),
    Case("mha-bf16-d64-b32-alibi", BF16, 4, 4, 64, 32, ((100, 100), (333, 5), (17, 9)),
         alibi=True),
    Case("mha-f32-d128-b16", F32, 4, 4, 128, 16, ((64, 64), (250, 31), (33, 1))),
    Case("mha-f16-d256-b8-alibi", F16, 2, 2, 256, 8, ((120, 50), (7, 7), (41, 2)), alibi=True),
    # Head sizes below their bucket's maximum; groups that do not divide the rows.
    Case("gqa9to3-f16-d40-b16", F16, 9, 3, 40, 16, ((70, 70), (150, 4)), alibi=True),
    Case("mqa6-bf16-d80-b8", BF16, 6, 1, 80, 8, ((180, 45), (24, 1), (9, 9))),
    Case("mqa16-f32-d192-b32", F32, 16, 1, 192, 32, ((75, 12), (140, 2)), alibi=True),
    Case("tiny-bf16-d8-b16", BF16, 4, 2, 8, 16, ((40, 40), (19, 2))),
    # Groups larger than a CTA's rows: 64:1 over 4 CTAs per kv head (head size 256: 16 rows
    # per CTA), 17:1 over 2 CTAs of 9 and 8 heads.
    Case("mqa64-bf16-d256-b16", BF16, 64, 1, 256, 16, ((40, 3), (20, 1))),
    Case("mqa17-f16-d136-b8", F16, 17, 1, 136, 8, ((45, 6), (3, 3)), alibi=True),
    # Longer contexts: a chunk after a 520-token prefix, decode rows only.
    Case("long-f32-d128-b8", F32, 8, 2, 128, 8, ((560, 40), (520, 1))),
    Case("decode-f16-d128-b32-alibi", F16, 8, 2, 128, 32, ((700, 1), (1, 1), (64, 1), (33, 1)),
         alibi=True),
    # Strided query rows, kv scales, garbage table columns past each sequence, a larger grid.
    Case("fused-qkv-f16-d64-b16", F16, 8, 2, 64, 16, ((60, 25), (130, 7)), query="fused_qkv"),
    Case("scales-bf16-d128-b32", BF16, 8, 4, 128, 32, ((110, 30), (35, 35)), alibi=True,
         k_scale=0.5, v_scale=2.0),
    Case("garbage-table-f32-d64-b16", F32, 4, 2, 64, 16, ((50, 20), (1, 1), (95, 2)),
         table_extra_cols=4, table_fill="garbage", max_query_len_extra=40),
    # Unvalidated metadata: lengths past the table, negative lengths, query_start_loc
    # outside [0, num_tokens] and decreasing, garbage block ids inside the lengths.
    Case("corrupt-f16-d128-b8", F16, 8, 2, 128, 8, ((40, 12), (30, 5), (20, 4), (9, 3)),
         table_fill="garbage", table_extra_cols=3, corrupt=True),
    Case("corrupt-f32-d64-b32", F32, 4, 4, 64, 32, ((70, 20), (33, 10)),
         table_fill="garbage", table_extra_cols=2, corrupt=True),
    # The flash layout: each dtype and block size, GQA / MHA / MQA, a head size below its
    # bucket, corrupt metadata.
    Case("flash-gqa-f32-d64-b8", F32, 8, 2, 64, 8, ((37, 37), (300, 1), (129, 20), (0, 0)),
         flash=True),
    Case("flash-gqa-f16-d128-b16-alibi", F16, 8, 2, 128, 16, ((150, 70), (1, 1), (260, 1)),
         alibi=True, flash=True),
    Case("flash-mha-bf16-d64-b32", BF16, 4, 4, 64, 32, ((100, 100), (333, 5)), flash=True),
    Case("flash-mqa6-bf16-d80-b8", BF16, 6, 1, 80, 8, ((180, 45), (24, 1), (9, 9)), flash=True),
    Case("flash-corrupt-f16-d128-b8", F16, 8, 2, 128, 8, ((40, 12), (30, 5), (9, 3)),
         table_fill="garbage", table_extra_cols=3, corrupt=True, flash=True),
]

# The tensor-core kernel's shapes: (context, new tokens) with prefixes of 0 tokens, part of
# a block and several blocks, and new-token counts around its 64-row CTA tile.
TC_CASES = [
    Case("tc-gqa4-bf16-d128-b16", BF16, 8, 2, 128, 16,
         ((130, 130), (27, 17), (214, 64), (301, 1)), cc=80),
    Case("tc-gqa8-f16-d64-b32-flash", F16, 8, 1, 64, 32,
         ((17, 17), (104, 64), (200, 130), (91, 1)), flash=True, cc=90),
    Case("tc-mha-bf16-d64-b8-alibi", BF16, 2, 2, 64, 8, ((64, 64), (167, 17), (135, 130), (1, 1)),
         alibi=True, cc=90),
    Case("tc-gqa4-f16-d128-b8-flash-alibi", F16, 4, 1, 128, 8, ((130, 130), (90, 17), (65, 1)),
         alibi=True, flash=True, cc=80),
    Case("tc-gqa8-bf16-d128-b32-scales", BF16, 8, 1, 128, 32, ((81, 64), (17, 17), (300, 1)),
         query="fused_qkv", k_scale=0.5, v_scale=2.0, cc=90),
    Case("tc-gqa3-f16-d64-b16", F16, 9, 3, 64, 16, ((70, 70), (150, 4), (0, 0)), cc=90),
]


def takes_tensor_cores(cc: int, dtype: torch.dtype, kv: str, head_size: int) -> bool:
    """The launcher's kernel choice (csrc/cuda/attention/attention_path.h), stated here
    independently: the tensor-core prefill kernel on sm_80 and newer for 16-bit queries with
    caches of their dtype, head sizes 64 and 128, any group size and either layout."""
    return cc >= 80 and dtype in (F16, BF16) and kv == "auto" and head_size in (64, 128)


def _params() -> list:
    """The SIMT cases, the tensor-core cases, and every SIMT case the tensor-core kernel
    takes once more planned for sm_90 (default: the corrupt-metadata ones)."""
    params = [pytest.param(c, id=c.id) for c in CASES + TC_CASES]
    for c in CASES:
        if takes_tensor_cores(90, c.dtype, "auto", c.head_size):
            c90 = dataclasses.replace(c, id=f"{c.id}-sm90", cc=90)
            params.append(pytest.param(c90, id=c90.id,
                                       marks=() if c.corrupt else pytest.mark.full_grid))
    return params


PARAMS = _params()
ALL_CASES = [p.values[0] for p in PARAMS]


@dataclass
class Prepared:
    case: Case
    dir: harness.CaseDir
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slopes: torch.Tensor | None
    scale: float
    storage: torch.Tensor
    out: torch.Tensor  # the NaN template (shape / dtype of out)


def _query(c: Case, num_tokens: int, g: torch.Generator) -> torch.Tensor:
    t, h, d = num_tokens, c.num_heads, c.head_size
    if c.query == "contiguous":
        return torch.randn(t, h, d, generator=g).to(c.dtype)
    big = torch.randn(t, (h + 2 * c.num_kv_heads) * d, generator=g).to(c.dtype)
    return big[:, : h * d].view(t, h, d)


def _corrupt(c: Case, kv, qsl: torch.Tensor, num_tokens: int):
    """Lengths and query ranges no validation let through (the kernel clamps them)."""
    lens = kv.seq_lens.clone()
    lens[0] = 2**31 - 1  # past the table: clamped to its columns (garbage ids -> zeros)
    if len(lens) > 2:
        lens[2] = -5
    qsl = qsl.clone()
    qsl[1] = num_tokens + 1000  # past the end
    if len(qsl) > 3:
        qsl[2] = -3  # negative, and below qsl[1]
    # The table's first row holds garbage ids inside the sequence's length too.
    tables = kv.block_tables.clone()
    tables[0, 1] = -7
    tables[-1, 0] = 2**31 - 1
    return lens, qsl, tables


def prepare(c: Case, root) -> Prepared:
    g = torch.Generator().manual_seed(zlib.crc32(c.id.encode()))
    lens = [ctx for ctx, _ in c.seqs]
    news = [new for _, new in c.seqs]
    max_len = max(lens)
    cols = max(1, math.ceil(max_len / c.block_size)) + c.table_extra_cols
    kv = make_paged_kv(lens, c.num_kv_heads, c.head_size, c.block_size, c.dtype, "cpu", g,
                       table_cols=cols, unused_table_fill=c.table_fill)
    num_tokens = sum(news)
    qsl = torch.tensor([0] + news, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = _query(c, num_tokens, g)
    slopes = alibi_slopes(c.num_heads) if c.alibi else None
    scale = 1.0 / math.sqrt(c.head_size)
    storage, q_off = harness.storage_of(query)
    out = torch.full((num_tokens, c.num_heads, c.head_size), float("nan"), dtype=c.dtype)
    seq_lens, tables = kv.seq_lens, kv.block_tables
    if c.flash:
        kv.key_cache, kv.value_cache = split_to_flash(kv.key_cache, kv.value_cache)
    if c.corrupt:
        seq_lens, qsl, tables = _corrupt(c, kv, qsl, num_tokens)

    cd = case_dir(root, c.id)
    cd.set(op="varlen", dtype=CODE[c.dtype], num_seqs=len(c.seqs), num_tokens=num_tokens,
           num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_size=c.head_size,
           block_size=c.block_size, num_blocks=kv.key_cache.shape[0], max_blocks_per_seq=cols,
           q_stride_seq=query.stride(0), q_stride_head=query.stride(1), q_offset=q_off,
           max_query_len=max(news) + c.max_query_len_extra, scale=scale,
           k_scale=c.k_scale, v_scale=c.v_scale, flash=int(c.flash), cc=c.cc)
    cd.buf("path", np.full(1, -1, dtype=np.int32), out=True)
    cd.buf("query_storage", storage, out=True)
    cd.buf("key_cache", kv.key_cache, out=True)
    cd.buf("value_cache", kv.value_cache, out=True)
    cd.buf("block_tables", tables)
    cd.buf("seq_lens", seq_lens)
    cd.buf("query_start_loc", qsl)
    if slopes is not None:
        cd.buf("alibi_slopes", slopes)
    cd.buf("out", out, out=True)
    cd.write()
    return Prepared(c, cd, query, kv.key_cache, kv.value_cache, tables, seq_lens, qsl, slopes,
                    scale, storage, out)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case prepared and run (its selected seeds) in one emulator process."""
    want = harness.selected(request, "case") | harness.selected(request, "name")
    root = tmp_path_factory.mktemp("emu_varlen")
    prepared = {c.id: prepare(c, root) for c in ALL_CASES if c.id in want}
    results = harness.run_cases([p.dir.path for p in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


@pytest.mark.parametrize("seed", harness.seed_params())
@pytest.mark.parametrize("case", PARAMS)
def test_varlen_paged_attention_emulated(runs, case, seed):
    prepared, results = runs
    p = prepared[case.id]
    res = results[p.dir.path]
    assert res.ok, res.message
    d = p.dir
    path = int(d.read("path", seed, torch.empty(1, dtype=torch.int32)))
    want_tc = takes_tensor_cores(case.cc, case.dtype, "auto", case.head_size)
    assert path == int(want_tc), f"kernel path {path}, expected tensor cores: {want_tc}"
    for name, t in (("query_storage", p.storage), ("key_cache", p.key_cache),
                    ("value_cache", p.value_cache)):
        assert_bitwise_equal(d.read(name, seed, t), t, f"{name} must not be modified")
    if case.corrupt:
        return  # no fault (ASan) and unchanged inputs is all corrupt metadata promises
    out = d.read("out", seed, p.out)
    ref = ref_varlen_paged_attention(p.query, p.key_cache, p.value_cache, case.num_kv_heads,
                                     p.scale, p.block_tables, p.seq_lens, p.query_start_loc,
                                     case.block_size, p.slopes, case.k_scale, case.v_scale)
    assert_close(out, ref, case.dtype, f"out ({dtype_name(case.dtype)})")


def test_varlen_path_choice(tmp_path):
    """attention_path.h's varlen_path over compute capabilities, dtypes, cache formats and
    head sizes (boundaries included) against takes_tensor_cores."""
    rows, want = [], []
    for cc, (dt, q16), kv, hs in itertools.product(
            (70, 75, 80, 86, 89, 90, 100, 120), ((F32, 0), (F16, 1), (BF16, 1)),
            ("auto", "fp8_e4m3"), (32, 48, 64, 80, 96, 128, 192, 256)):
        rows.append([cc, q16, int(kv == "auto"), hs])
        want.append(int(takes_tensor_cores(cc, dt, kv, hs)))
    c = case_dir(tmp_path, "varlen_path")
    c.set(op="varlen_path")
    c.buf("in", np.array(rows, dtype=np.int32))
    c.buf("out", np.full(len(rows), -1, dtype=np.int32), out=True)
    c.write()
    res = harness.run_cases([c.path], [0])[c.path]
    assert res.ok, res.message
    got = c.read("out", 0, torch.empty(len(rows), dtype=torch.int32)).tolist()
    bad = [(r, g, w) for r, g, w in zip(rows, got, want) if g != w]
    assert not bad, f"(cc, 16-bit, auto cache, head) -> got, want: {bad[:10]}"
    assert 0 < sum(want) < len(want)
