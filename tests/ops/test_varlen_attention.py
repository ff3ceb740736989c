"""varlen_paged_attention (prefill over the paged cache) against the float64 reference.

Every case: random K/V for each sequence's whole context in a shuffled pool, NaN in every
slot no sequence reads, out filled with NaN beforehand (every row must be written, no NaN
may leak in). Ragged query counts (1, several, a whole sequence) after cached prefixes from
0 tokens to several kernel chunks (128) and decode partitions (512), block boundaries,
GQA / MQA / MHA, ALiBi, fp8 caches, every CPU ISA build. Plus: a one-token sequence equals
paged_attention, the op traces under torch.compile, bad arguments raise before anything is
written.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from vllm_lite import ops

from .reference import (
    DTYPES,
    alibi_slopes,
    dtype_name,
    make_paged_kv,
    ref_varlen_paged_attention,
    split_to_flash,
    tol,
)

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class VarlenCase:
    id: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    alibi: bool
    # (context length including the new tokens, new tokens) per sequence
    seqs: tuple[tuple[int, int], ...]
    kv_cache_dtype: str = "auto"
    reduced: bool = True
    cpu_only: bool = False
    flash: bool = False  # the caches in the flash layout (split_to_flash)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


HEADS = [(9, 3), (8, 2), (4, 4), (6, 1), (16, 1), (64, 1)]
HEAD_SIZES = [64, 128, 80, 256, 16, 96]
BLOCK_SIZES = [16, 8, 32]
# (prefix, new) shapes: a fresh prompt, a prompt after a cached prefix, a decode row, a
# chunk after a multi-partition prefix, a one-token prompt.
SHAPES = [
    ((37, 37), (1, 1)),
    ((300, 100), (129, 129), (5, 1)),
    ((1100, 64), (640, 1), (17, 16)),
    ((257, 257), (520, 8), (0, 0), (33, 2)),
    ((1500, 300),),
    ((128, 128), (256, 1), (129, 2), (384, 127)),
]


def _cases() -> list[VarlenCase]:
    rng = random.Random(0xFA11)
    cases = []
    combos = [(dt, sh, alibi) for dt in DTYPES for sh in range(len(SHAPES))
              for alibi in (False, True)]
    for i, (dt, sh, alibi) in enumerate(combos):
        h, kvh = HEADS[i % len(HEADS)]
        d = HEAD_SIZES[(i // 2) % len(HEAD_SIZES)]
        bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        seqs = list(SHAPES[sh])
        rng.shuffle(seqs)
        cid = (f"{i:02d}-{dtype_name(dt)}-h{h}k{kvh}-d{d}-b{bs}-"
               + "_".join(f"{L}n{n}" for L, n in seqs) + ("-alibi" if alibi else ""))
        cases.append(VarlenCase(cid, h, kvh, d, bs, dt, alibi, tuple(seqs),
                                reduced=i % 3 == 0))
    # fp8 caches (CPU only: the CUDA ops refuse fp8), odd block sizes (CPU only).
    for j, (fmt, dt) in enumerate([(f, dt) for f in FP8 for dt in DTYPES]):
        seqs = SHAPES[(j + 1) % len(SHAPES)]
        cases.append(VarlenCase(f"{fmt}-{dtype_name(dt)}-{j}", 8, 2, 64, [16, 5][j % 2], dt,
                                j % 2 == 1, seqs, kv_cache_dtype=fmt, reduced=j % 2 == 0,
                                cpu_only=True))
    # bf16 too: the AVX512-BF16 task copies K and V into token pairs whatever the block size.
    for bs, dt in ((1, torch.float32), (7, torch.float32), (13, torch.float32),
                   (7, torch.bfloat16), (13, torch.bfloat16)):
        cases.append(VarlenCase(f"b{bs}-{dtype_name(dt)}", 12, 4, 64, bs, dt, bs == 7,
                                ((200, 60), (31, 31), (14, 1)), reduced=False, cpu_only=True))
    return cases


CASES = _cases()
# The flash layout: the reduced cases (every dtype and shape, fp8 both formats, ALiBi) and
# the odd block sizes, the same caches permuted into it.
CASES += [replace(c, id=f"{c.id}-flash", flash=True)
          for c in CASES if c.reduced or c.id.startswith("b7")]


def _fp8_caches(kv, fmt: str, k_scale: float, v_scale: float):
    """make_paged_kv's float32 caches (x = 4) as fp8 bytes (x = 16) holding key / k_scale
    and value / v_scale, and the dequantized float64 caches (x = 16 layout)."""
    kc, vc = kv.key_cache, kv.value_cache
    nb, h, _, bs, _ = kc.shape
    d = kv.head_size
    rows = kc.permute(0, 1, 3, 2, 4).reshape(nb, h, bs, d)
    k16 = rows.reshape(nb, h, bs, d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    k8 = (k16 / k_scale).to(FP8[fmt]).view(torch.uint8)
    v8 = (vc / v_scale).to(FP8[fmt]).view(torch.uint8)
    return k8, v8, k8.view(FP8[fmt]).double() * k_scale, v8.view(FP8[fmt]).double() * v_scale


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    ref_key: torch.Tensor
    ref_value: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slopes: torch.Tensor | None
    scale: float
    k_scale: float
    v_scale: float
    max_query_len: int
    max_seq_len: int


def build(case: VarlenCase, device: str) -> Inputs:
    g = torch.Generator().manual_seed(case.seed)
    lens = [L for L, _ in case.seqs]
    news = [n for _, n in case.seqs]
    fp8 = case.kv_cache_dtype != "auto"
    kv = make_paged_kv(lens, case.num_kv_heads, case.head_size, case.block_size,
                       torch.float32 if fp8 else case.dtype, "cpu", g,
                       table_cols=max(1, math.ceil(max(lens) / case.block_size)) + 1)
    k_scale = v_scale = 1.0
    kc, vc, rk, rv = kv.key_cache, kv.value_cache, kv.key_cache, kv.value_cache
    if fp8:
        k_scale, v_scale = 0.05, 0.5
        kc, vc, rk, rv = _fp8_caches(kv, case.kv_cache_dtype, k_scale, v_scale)
    if case.flash:
        kc, vc = split_to_flash(kc, vc)
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], case.num_heads, case.head_size, generator=g).to(case.dtype)
    return Inputs(
        query=query.to(device), key_cache=kc.to(device), value_cache=vc.to(device),
        ref_key=rk, ref_value=rv, block_tables=kv.block_tables.to(device),
        seq_lens=kv.seq_lens.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slopes=alibi_slopes(case.num_heads).to(device) if case.alibi else None,
        scale=1.0 / math.sqrt(case.head_size), k_scale=k_scale, v_scale=v_scale,
        max_query_len=max(news), max_seq_len=max(lens),
    )


def run(case: VarlenCase, inp: Inputs, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.full_like(inp.query, float("nan"))
    return ops.varlen_paged_attention(
        inp.query, inp.key_cache, inp.value_cache, case.num_kv_heads, inp.scale,
        inp.block_tables, inp.seq_lens, inp.query_start_loc, case.block_size,
        inp.max_query_len, inp.max_seq_len, inp.slopes, case.kv_cache_dtype, inp.k_scale,
        inp.v_scale, out=out)


def reference(case: VarlenCase, inp: Inputs) -> torch.Tensor:
    # ref_key / ref_value already hold the dequantized values (stored x scale).
    return ref_varlen_paged_attention(
        inp.query, inp.ref_key, inp.ref_value, case.num_kv_heads, inp.scale,
        inp.block_tables, inp.seq_lens, inp.query_start_loc, case.block_size, inp.slopes)


@pytest.mark.grid(CASES)
def test_varlen_against_float64(backend, case: VarlenCase) -> None:
    inp = build(case, backend.device)
    out = run(case, inp)
    want = reference(case, inp)
    assert not out.isnan().any(), "NaN in the output (a row left unwritten or a poisoned slot read)"
    torch.testing.assert_close(out.cpu().double(), want, **tol(case.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_one_token_rows_equal_paged_attention(backend, dtype) -> None:
    """A decode row through the varlen op gives paged_attention's result."""
    case = VarlenCase("decode", 8, 2, 64, 16, dtype, True,
                      ((700, 1), (1, 1), (64, 1), (1030, 1)))
    inp = build(case, backend.device)
    out = run(case, inp)
    want = ops.paged_attention(inp.query, inp.key_cache, inp.value_cache, case.num_kv_heads,
                               inp.scale, inp.block_tables, inp.seq_lens, case.block_size,
                               inp.max_seq_len, inp.slopes)
    torch.testing.assert_close(out, want, **tol(dtype))


def test_prefill_of_a_whole_prompt_matches_sdpa() -> None:
    """A fresh prompt (no prefix): the causal attention torch's SDPA computes."""
    case = VarlenCase("sdpa", 8, 2, 64, 16, torch.float32, False, ((300, 300), (77, 77)))
    inp = build(case, "cpu")
    out = run(case, inp)
    for s, (lo, hi) in enumerate([(0, 300), (300, 377)]):
        n = hi - lo
        t = torch.arange(n)
        blk = inp.block_tables[s].long()[t // case.block_size]
        k = inp.key_cache[blk, :, :, t % case.block_size, :].reshape(n, 2, 64)
        v = inp.value_cache[blk, :, :, t % case.block_size]
        want = torch.nn.functional.scaled_dot_product_attention(
            inp.query[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=inp.scale, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-4, rtol=1e-4)


def test_traces_under_torch_compile() -> None:
    case = VarlenCase("compile", 4, 2, 64, 16, torch.float32, False, ((40, 20), (9, 9)))
    inp = build(case, "cpu")

    def f(q):
        return ops.varlen_paged_attention(
            q, inp.key_cache, inp.value_cache, 2, inp.scale, inp.block_tables, inp.seq_lens,
            inp.query_start_loc, 16, inp.max_query_len, inp.max_seq_len) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(inp.query), f(inp.query))


def _bad(field: str, inp: Inputs, case: VarlenCase) -> dict:
    args = dict(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache,
                num_kv_heads=case.num_kv_heads, scale=inp.scale, block_tables=inp.block_tables,
                seq_lens=inp.seq_lens, query_start_loc=inp.query_start_loc,
                block_size=case.block_size, max_query_len=inp.max_query_len,
                max_seq_len=inp.max_seq_len)
    qsl, lens = inp.query_start_loc.clone(), inp.seq_lens.clone()
    if field == "query_start_loc_start":
        qsl[0] = 1
        args["query_start_loc"] = qsl
    elif field == "query_start_loc_end":
        qsl[-1] -= 1
        args["query_start_loc"] = qsl
    elif field == "query_start_loc_decreasing":
        qsl[1] = qsl[2] + 1
        args["query_start_loc"] = qsl
    elif field == "query_start_loc_length":
        args["query_start_loc"] = qsl[:-1]
    elif field == "query_start_loc_dtype":
        args["query_start_loc"] = qsl.long()
    elif field == "more_queries_than_context":
        lens[1] = int(qsl[2] - qsl[1]) - 1
        args["seq_lens"] = lens
    elif field == "max_query_len":
        args["max_query_len"] = inp.max_query_len - 1
    elif field == "max_seq_len":
        args["max_seq_len"] = inp.max_seq_len - 1
    elif field == "block_tables_rows":
        args["block_tables"] = inp.block_tables[:-1].contiguous()
    elif field == "block_id":
        t = inp.block_tables.clone()
        t[0, 0] = inp.key_cache.shape[0]
        args["block_tables"] = t
    elif field == "kv_cache_dtype":
        args["kv_cache_dtype"] = "fp16"
    elif field == "fp8_with_model_dtype_cache":
        args["kv_cache_dtype"] = "fp8"
    elif field == "k_scale":
        args["kv_cache_dtype"], args["k_scale"] = "auto", float("nan")
    else:
        raise AssertionError(field)
    return args


BAD = {
    "query_start_loc_start": "query_start_loc",
    "query_start_loc_end": "query_start_loc",
    "query_start_loc_decreasing": "query tokens",
    "query_start_loc_length": "query_start_loc must have",
    "query_start_loc_dtype": "query_start_loc must be Int",
    "more_queries_than_context": "seq_lens",
    "max_query_len": "max_query_len",
    "max_seq_len": "max_seq_len",
    "block_tables_rows": "block_tables has",
    "block_id": "block_tables",
    "kv_cache_dtype": "kv_cache_dtype 'fp16'",
    "fp8_with_model_dtype_cache": "key_cache must be",
    "k_scale": "k_scale",
}


@pytest.mark.parametrize("field", list(BAD))
def test_bad_arguments_raise_and_write_nothing(field: str) -> None:
    case = VarlenCase("bad", 4, 2, 64, 16, torch.float32, False, ((40, 20), (30, 9), (5, 2)))
    inp = build(case, "cpu")
    out = torch.full_like(inp.query, float("nan"))
    with pytest.raises(RuntimeError, match=f"varlen_paged_attention: .*{BAD[field]}"):
        ops.varlen_paged_attention(**_bad(field, inp, case), out=out)
    assert out.isnan().all(), "out was written before the error"
