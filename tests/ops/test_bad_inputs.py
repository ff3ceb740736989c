"""Invalid arguments raise RuntimeError with the message of csrc/validate.cpp, on every
device, and a rejected call changes nothing (outputs and caches keep their bits).

Each test starts from a valid call and breaks one thing. Where the CPU and CUDA paths word
a value check differently (the CPU names the offending element; CUDA reports it after
one device round trip), the pattern accepts both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch

from vllm_lite import ops

from .conftest import CUDA_SKIP
from .reference import assert_bitwise_equal, elem_x, nan_like

needs_cuda = pytest.mark.skipif(CUDA_SKIP is not None, reason=CUDA_SKIP or "")


@dataclass
class Attn:
    """A valid paged_attention call; tests replace one field."""

    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_kv_heads: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    max_seq_len: int
    alibi_slopes: torch.Tensor | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    scale: float = 0.125
    exp_sums: torch.Tensor | None = None
    max_logits: torch.Tensor | None = None
    tmp_out: torch.Tensor | None = None

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.num_kv_heads, self.scale,
                self.block_tables, self.seq_lens, self.block_size, self.max_seq_len,
                self.alibi_slopes, self.kv_cache_dtype, self.k_scale, self.v_scale)

    def v1(self):
        ops.paged_attention_v1(self.out, *self.args())

    def v2(self):
        ops.paged_attention_v2(self.out, self.exp_sums, self.max_logits, self.tmp_out,
                               *self.args())


def attn(device, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_size=64,
         block_size=16, num_blocks=10, max_seq_len=50, lens=(50, 20), cols=None) -> Attn:
    g = torch.Generator().manual_seed(0)
    s = len(lens)
    x = elem_x(dtype)
    cols = cols if cols is not None else -(-max_seq_len // block_size)
    q = torch.randn(s, num_heads, head_size, generator=g).to(dtype)
    kc = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x, generator=g)
    vc = torch.randn(num_blocks, num_kv_heads, head_size, block_size, generator=g)
    tables = torch.randint(num_blocks, (s, cols), generator=g, dtype=torch.int32)
    p = max(1, -(-max_seq_len // 512))
    a = Attn(
        out=torch.full((s, num_heads, head_size), float("nan"), dtype=dtype),
        query=q, key_cache=kc.to(dtype), value_cache=vc.to(dtype), num_kv_heads=num_kv_heads,
        block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_size=block_size, max_seq_len=max_seq_len,
        exp_sums=torch.full((s, num_heads, p), float("nan")),
        max_logits=torch.full((s, num_heads, p), float("nan")),
        tmp_out=torch.full((s, num_heads, p, head_size), float("nan"), dtype=dtype),
    )
    for f in ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens",
              "exp_sums", "max_logits", "tmp_out"):
        setattr(a, f, getattr(a, f).to(device))
    return a


def expect_error(a: Attn, pattern: str, versions=("v1", "v2")) -> None:
    """Both versions reject ``a`` with ``pattern`` and leave out and the scratch as NaN."""
    for v in versions:
        before = [t.clone() for t in (a.out, a.exp_sums, a.max_logits, a.tmp_out)]
        with pytest.raises(RuntimeError, match=pattern):
            getattr(a, v)()
        for t, b, name in zip((a.out, a.exp_sums, a.max_logits, a.tmp_out), before,
                              ("out", "exp_sums", "max_logits", "tmp_out")):
            assert_bitwise_equal(t, b, f"{v}: {name} after a rejected call")


def test_valid_base_calls_pass(device):
    a = attn(device)
    a.v1()
    a.v2()
    assert not a.out.isnan().any()


# --- paged attention -------------------------------------------------------------------


def test_kv_cache_dtype(device):
    expect_error(replace(attn(device), kv_cache_dtype="fp8_e4m3fnuz"),
                 r"paged_attention: kv_cache_dtype 'fp8_e4m3fnuz' is not supported; use 'auto'")
    # fp8 caches are uint8 (tests/ops/test_fp8_kv.py runs them); float ones are refused.
    expect_error(replace(attn(device), kv_cache_dtype="fp8"),
                 re.escape("paged_attention: key_cache must be uint8 (Byte) for an fp8 "
                           "kv_cache_dtype"))
    a = attn(device)
    u8 = dict(key_cache=torch.zeros(a.key_cache.shape[:2] + (4, 16, 16), dtype=torch.uint8,
                                    device=device),
              value_cache=torch.zeros(a.value_cache.shape, dtype=torch.uint8, device=device))
    # A well-formed fp8 call runs on every device (the CUDA kernels read fp8 too).
    ok = replace(a, kv_cache_dtype="fp8", **u8)
    ok.v1()
    assert torch.isfinite(ok.out).all()
    expect_error(replace(a, **u8), r"paged_attention: key_cache must be Float for kv_cache_dtype "
                                   r"'auto', got Byte \(a uint8 cache holds fp8")


@pytest.mark.parametrize("k_scale,v_scale", [(0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0),
                                             (1.0, float("inf"))])
def test_bad_kv_scales(device, k_scale, v_scale):
    expect_error(replace(attn(device), k_scale=k_scale, v_scale=v_scale),
                 r"paged_attention: k_scale and v_scale must be finite and positive")


def test_float64_query(device):
    a = attn(device)
    a = replace(a, query=a.query.double(), out=a.out.double())
    expect_error(a, r"paged_attention: query must be float32, float16 or bfloat16, got Double")


@pytest.mark.parametrize("head_size", [12, 264, 0])
def test_unsupported_head_size(device, head_size):
    a = attn(device)
    q = torch.randn(2, 4, head_size, device=device)
    a = replace(a, query=q, out=nan_like(q))
    expect_error(a, re.escape(f"paged_attention: head_size must be a multiple of 8 in [8, 256], "
                              f"got {head_size}"), versions=("v1",))


def test_query_last_dim_strided(device):
    a = attn(device)
    q = torch.randn(2, 4, 128, device=device)[..., ::2]
    expect_error(replace(a, query=q),
                 r"paged_attention: query's last dimension must be contiguous, got strides")


def test_out_mismatch(device):
    a = attn(device)
    expect_error(replace(a, out=a.out.half()), r"paged_attention: out must be Float, got Half")
    bad = torch.full((2, 4, 32), float("nan"), device=device)
    expect_error(replace(a, out=bad), re.escape("paged_attention: out must have query's shape "
                                                "[2, 4, 64], got [2, 4, 32]"))
    strided = torch.full((4, 2, 64), float("nan"), device=device).transpose(0, 1)
    expect_error(replace(a, out=strided), r"paged_attention: out must be contiguous, got shape")


@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
def test_non_contiguous_cache(device, which):
    a = attn(device)
    t = getattr(a, which)
    # Same shape, other strides: the two middle dimensions stored transposed.
    nc = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert nc.shape == t.shape and not nc.is_contiguous()
    expect_error(replace(a, **{which: nc}), rf"paged_attention: {which} must be contiguous")


def test_cache_dtype_and_shape(device):
    a = attn(device)
    expect_error(replace(a, key_cache=a.key_cache.half()),
                 r"paged_attention: key_cache must be Float for kv_cache_dtype 'auto', got Half")
    expect_error(replace(a, value_cache=a.value_cache.bfloat16()),
                 r"paged_attention: value_cache must be Float for kv_cache_dtype 'auto', "
                 r"got BFloat16")
    # A key cache with the fp16 x (8) for a float32 query (x = 4).
    wrong_x = torch.zeros(10, 2, 8, 16, 8, device=device)
    expect_error(replace(a, key_cache=wrong_x), re.escape(
        "paged_attention: key_cache must have shape [10, 2, 16, 16, 4] for num_kv_heads=2, "
        "head_size=64, block_size=16, x=4, got [10, 2, 8, 16, 8]"))
    expect_error(replace(a, key_cache=a.key_cache[..., 0, 0]),
                 r"paged_attention: key_cache must be 5-D .* \(split layout\) or 4-D "
                 r".* \(flash layout\), got 3-D")
    # A 4-D key cache is the flash layout: its shape, and the value cache's, must match.
    flash_k = torch.zeros(10, 16, 2, 64, device=device)
    expect_error(replace(a, key_cache=flash_k), re.escape(
        "paged_attention: value_cache must have key_cache's shape [10, 16, 2, 64] "
        "(flash layout), got [10, 2, 64, 16]"))
    expect_error(replace(a, key_cache=flash_k[:, :, :1].contiguous(),
                         value_cache=flash_k[:, :, :1].contiguous()), re.escape(
        "paged_attention: key_cache must have shape [10, 16, 2, 64] (flash layout) for "
        "num_kv_heads=2, head_size=64, block_size=16, got [10, 16, 1, 64]"))
    expect_error(replace(a, key_cache=flash_k, value_cache=a.value_cache[..., 0]),
                 re.escape("paged_attention: value_cache must be 4-D [num_blocks, block_size, "
                           "num_kv_heads, head_size] (the flash layout, as key_cache)"))


def test_num_heads_not_multiple_of_kv_heads(device):
    a = attn(device, num_heads=6, num_kv_heads=4)
    expect_error(a, re.escape("paged_attention: num_heads (6) must be a multiple of "
                              "num_kv_heads (4)"))


def test_too_many_heads_per_kv_head(device):
    expect_error(attn(device, num_heads=128, num_kv_heads=1),
                 r"paged_attention: at most 64 query heads per KV head are supported, got 128")


def test_index_dtypes(device):
    a = attn(device)
    expect_error(replace(a, block_tables=a.block_tables.long()),
                 r"paged_attention: block_tables must be Int, got Long")
    expect_error(replace(a, seq_lens=a.seq_lens.long()),
                 r"paged_attention: seq_lens must be Int, got Long")
    nc = a.block_tables.t().contiguous().t()
    expect_error(replace(a, block_tables=nc),
                 r"paged_attention: block_tables must be contiguous, got shape")
    expect_error(replace(a, block_tables=a.block_tables[:1]),
                 r"paged_attention: block_tables has 1 rows but query has 2 sequences")
    expect_error(replace(a, seq_lens=a.seq_lens[:1]),
                 r"paged_attention: seq_lens has 1 entries but query has 2 sequences")


def test_block_table_shorter_than_max_seq_len_needs(device):
    a = attn(device, max_seq_len=50, lens=(40, 20), cols=3)  # 50 tokens need 4 blocks of 16
    expect_error(a, re.escape("paged_attention: block_tables has 3 columns, fewer than the 4 "
                              "blocks that max_seq_len=50 needs at block_size=16"))


@pytest.mark.parametrize("lens", [(60, 20), (20, -1)])
def test_seq_len_outside_range(device, lens):
    a = attn(device, max_seq_len=50, cols=5)
    a = replace(a, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device))
    # CPU: "seq_lens[0] = 60 is outside [0, max_seq_len=50]";
    # CUDA: "seq_lens must lie in [0, max_seq_len=50], got values in [20, 60]".
    expect_error(a, r"paged_attention: seq_lens(\[\d\] = -?\d+ is outside| must lie in) "
                    r"\[0, max_seq_len=50\]")


@pytest.mark.parametrize("bad_id", [10, -1, 2**31 - 1])
def test_block_id_outside_pool(device, bad_id):
    a = attn(device, num_blocks=10)
    a.block_tables[0, 1] = bad_id  # within sequence 0's 50 tokens
    expect_error(a, r"paged_attention: block_tables.* outside the cache's 10 blocks")


def test_negative_max_seq_len(device):
    a = attn(device)
    expect_error(replace(a, max_seq_len=-1),
                 r"paged_attention: max_seq_len must be non-negative, got -1", versions=("v1",))


def test_bad_alibi_slopes(device):
    a = attn(device)
    expect_error(replace(a, alibi_slopes=torch.ones(4, dtype=torch.float64, device=device)),
                 r"paged_attention: alibi_slopes must be Float, got Double")
    expect_error(replace(a, alibi_slopes=torch.ones(3, device=device)),
                 re.escape("paged_attention: alibi_slopes must be a contiguous [num_heads=4] "
                           "tensor, got shape [3]"))


def test_bad_v2_scratch(device):
    a = attn(device, max_seq_len=1100, lens=(1100, 20), num_blocks=80)  # 3 partitions
    two = torch.full((2, 4, 2), float("nan"), device=device)
    four = torch.full((2, 4, 4), float("nan"), device=device)
    expect_error(replace(a, exp_sums=two), re.escape(
        "paged_attention_v2: exp_sums must be [2, 4, >= 3] for max_seq_len=1100, got "
        "[2, 4, 2]"), versions=("v2",))
    expect_error(replace(a, max_logits=two.clone()), re.escape(
        "paged_attention_v2: max_logits must be [2, 4, >= 3]"), versions=("v2",))
    expect_error(replace(a, max_logits=four), re.escape(
        "paged_attention_v2: max_logits [2, 4, 4] and exp_sums [2, 4, 3] must have one shape"),
        versions=("v2",))
    expect_error(replace(a, exp_sums=a.exp_sums.half()),
                 r"paged_attention_v2: exp_sums must be Float, got Half", versions=("v2",))
    expect_error(replace(a, tmp_out=a.tmp_out[:, :, :2].contiguous()), re.escape(
        "paged_attention_v2: tmp_out must have shape [2, 4, 3, 64], got [2, 4, 2, 64]"),
        versions=("v2",))
    expect_error(replace(a, tmp_out=a.tmp_out.half()),
                 r"paged_attention_v2: tmp_out must be Float, got Half", versions=("v2",))
    nc = a.exp_sums.transpose(0, 1).contiguous().transpose(0, 1)
    expect_error(replace(a, exp_sums=nc), r"paged_attention_v2: exp_sums must be contiguous",
                 versions=("v2",))


@needs_cuda
def test_mismatched_devices_attention():
    a = attn("cuda")
    for field in ("key_cache", "value_cache", "block_tables", "seq_lens"):
        b = replace(a, **{field: getattr(a, field).cpu()})
        expect_error(b, rf"paged_attention: {field} is on cpu but query is on cuda:\d; all "
                        r"tensors must be on one device")
    expect_error(replace(a, alibi_slopes=torch.ones(4)),
                 r"paged_attention: alibi_slopes is on cpu but query is on cuda")
    expect_error(replace(a, exp_sums=a.exp_sums.cpu()),
                 r"paged_attention_v2: exp_sums is on cpu but out is on cuda", versions=("v2",))


@needs_cuda
def test_cuda_unsupported_block_size():
    expect_error(attn("cuda", block_size=64, num_blocks=4), r"block_size")


# --- reshape_and_cache -----------------------------------------------------------------


@dataclass
class Write:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    flash: bool = False

    @property
    def name(self):
        return "reshape_and_cache_flash" if self.flash else "reshape_and_cache"

    def call(self):
        fn = ops.reshape_and_cache_flash if self.flash else ops.reshape_and_cache
        fn(self.key, self.value, self.key_cache, self.value_cache, self.slot_mapping,
           self.kv_cache_dtype, self.k_scale, self.v_scale)


def write(device, flash=False, dtype=torch.float32, n=5, kvh=2, d=64, bs=16, nb=10) -> Write:
    g = torch.Generator().manual_seed(1)
    x = elem_x(dtype)
    if flash:
        ks = vs = (nb, bs, kvh, d)
    else:
        ks, vs = (nb, kvh, d // x, bs, x), (nb, kvh, d, bs)
    return Write(
        key=torch.randn(n, kvh, d, generator=g).to(dtype).to(device),
        value=torch.randn(n, kvh, d, generator=g).to(dtype).to(device),
        key_cache=torch.full(ks, float("nan"), dtype=dtype, device=device),
        value_cache=torch.full(vs, float("nan"), dtype=dtype, device=device),
        slot_mapping=torch.tensor([3, -1, 17, 159, 40][:n], device=device),
        flash=flash,
    )


def expect_write_error(w: Write, pattern: str) -> None:
    kc, vc = w.key_cache.clone(), w.value_cache.clone()
    with pytest.raises(RuntimeError, match=pattern):
        w.call()
    assert_bitwise_equal(w.key_cache, kc, f"{w.name}: key_cache after a rejected call")
    assert_bitwise_equal(w.value_cache, vc, f"{w.name}: value_cache after a rejected call")


flash_param = pytest.mark.parametrize("flash", [False, True], ids=["paged", "flash"])


@flash_param
def test_write_valid_base_passes(device, flash):
    write(device, flash).call()


@flash_param
def test_write_kv_cache_dtype_fp8(device, flash):
    w = replace(write(device, flash), kv_cache_dtype="fp8_e5m3")
    expect_write_error(w, rf"{w.name}: kv_cache_dtype 'fp8_e5m3' is not supported")
    w = replace(write(device, flash), kv_cache_dtype="fp8")
    expect_write_error(w, rf"{w.name}: key_cache must be uint8 \(Byte\) for an fp8 "
                          r"kv_cache_dtype")
    w = replace(write(device, flash), v_scale=0.0)
    expect_write_error(w, rf"{w.name}: k_scale and v_scale must be finite and positive")


@flash_param
def test_write_slot_mapping_int32(device, flash):
    w = write(device, flash)
    expect_write_error(replace(w, slot_mapping=w.slot_mapping.int()),
                       rf"{w.name}: slot_mapping must be Long, got Int")
    expect_write_error(replace(w, slot_mapping=w.slot_mapping[:4]),
                       rf"{w.name}: slot_mapping has 4 entries but key has 5 tokens")


@flash_param
@pytest.mark.parametrize("bad_slot", [160, 10**9])
def test_write_slot_beyond_cache(device, flash, bad_slot):
    """The other slots are valid: nothing at all may be written."""
    w = write(device, flash)
    w.slot_mapping[2] = bad_slot
    # The op's name prefixes the message; not asserted here because validate.cpp names
    # "reshape_and_cache" for the flash variant too.
    expect_write_error(w, re.escape(f"slot_mapping holds slot {bad_slot} but the cache has only "
                                    f"160 slots (10 blocks of 16)"))


@flash_param
def test_write_non_contiguous_caches(device, flash):
    w = write(device, flash)
    for which in ("key_cache", "value_cache"):
        t = getattr(w, which)
        nc = t.transpose(1, 2).contiguous().transpose(1, 2)
        expect_write_error(replace(w, **{which: nc}), rf"{w.name}: {which} must be contiguous")


@flash_param
def test_write_dtypes_and_shapes(device, flash):
    w = write(device, flash)
    expect_write_error(replace(w, key=w.key.double(), value=w.value.double()),
                       rf"{w.name}: key must be float32, float16 or bfloat16, got Double")
    expect_write_error(replace(w, value=w.value.half()),
                       rf"{w.name}: value must be Float, got Half")
    expect_write_error(replace(w, key_cache=w.key_cache.half()),
                       rf"{w.name}: key_cache must be Float for kv_cache_dtype 'auto', got Half")
    expect_write_error(replace(w, value=w.value[:, :1]),
                       re.escape(f"{w.name}: value must have key's shape [5, 2, 64], got "
                                 f"[5, 1, 64]"))
    other = write(device, flash, kvh=4)
    expect_write_error(replace(w, key_cache=other.key_cache, value_cache=other.value_cache),
                       rf"{w.name}: key_cache must have shape")


@flash_param
@pytest.mark.parametrize("head_size", [12, 264])
def test_write_unsupported_head_size(device, flash, head_size):
    w = write(device, flash)
    k = torch.randn(5, 2, head_size, device=device)
    expect_write_error(replace(w, key=k, value=k.clone()), re.escape(
        f"{w.name}: head_size must be a multiple of 8 in [8, 256], got {head_size}"))


@flash_param
def test_write_heads_not_packed(device, flash):
    w = write(device, flash)
    big = torch.randn(5, 2, 128, device=device)
    expect_write_error(replace(w, key=big[:, :, :64]), re.escape(
        f"{w.name}: key must have packed heads (strides [*, 64, 1]), got strides [256, 128, 1]"))


@needs_cuda
def test_write_mismatched_devices():
    w = write("cuda")
    expect_write_error(replace(w, slot_mapping=w.slot_mapping.cpu()),
                       r"reshape_and_cache: slot_mapping is on cpu but key is on cuda")


# --- copy_blocks ------------------------------------------------------------------------


def caches(device, layers=2, nb=10, dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    kcs = [torch.randn(nb, 2, 16, 16, 4, generator=g).to(dtype).to(device) for _ in range(layers)]
    vcs = [torch.randn(nb, 2, 64, 16, generator=g).to(dtype).to(device) for _ in range(layers)]
    return kcs, vcs


def expect_copy_error(kcs, vcs, mapping, pattern):
    before = [t.clone() for t in kcs + vcs]
    with pytest.raises(RuntimeError, match=pattern):
        ops.copy_blocks(kcs, vcs, mapping)
    for t, b in zip(kcs + vcs, before):
        assert_bitwise_equal(t, b, "copy_blocks: a cache after a rejected call")


@pytest.mark.parametrize("pairs,lo,hi", [([[0, 1], [12, 3]], 0, 12), ([[0, 1], [2, -1]], -1, 2),
                                         ([[10, 1]], 1, 10)])
def test_copy_blocks_mapping_out_of_range(device, pairs, lo, hi):
    kcs, vcs = caches(device)
    m = torch.tensor(pairs, device=device)
    expect_copy_error(kcs, vcs, m, re.escape(
        f"copy_blocks: block_mapping holds block ids in [{lo}, {hi}] but the caches have 10 "
        f"blocks"))


def test_copy_blocks_bad_arguments(device):
    kcs, vcs = caches(device)
    m = torch.tensor([[0, 1]], device=device)
    expect_copy_error(kcs, vcs, m.int(), r"copy_blocks: block_mapping must be Long, got Int")
    expect_copy_error(kcs, vcs, torch.zeros(2, 3, dtype=torch.long, device=device),
                      re.escape("copy_blocks: block_mapping must be [num_pairs, 2], got [2, 3]"))
    expect_copy_error(kcs, vcs, m[0], r"copy_blocks: block_mapping must be 2-D")
    expect_copy_error(kcs, vcs[:1], m, r"copy_blocks: got 2 key caches but 1 value caches")
    nc = kcs[1].transpose(1, 2).contiguous().transpose(1, 2)
    expect_copy_error([kcs[0], nc], vcs, m, re.escape("copy_blocks: key_caches[1] must be "
                                                      "contiguous"))
    expect_copy_error(kcs, [vcs[0].half(), vcs[1]], m,
                      re.escape("copy_blocks: value_caches[0] is Half but key_caches[0] is "
                                "Float"))
    fewer = caches(device, nb=8)[0]
    expect_copy_error([kcs[0], fewer[1]], vcs, m, re.escape(
        "copy_blocks: key_caches[1] has shape [8, 2, 16, 16, 4] but key_caches[0] has 10 "
        "blocks"))


@needs_cuda
def test_copy_blocks_mapping_on_other_device():
    kcs, vcs = caches("cuda")
    expect_copy_error(kcs, vcs, torch.tensor([[0, 1]]),
                      r"copy_blocks: block_mapping is on cpu but the caches are on cuda")


# --- swap_blocks ------------------------------------------------------------------------


def expect_swap_error(src, dst, mapping, pattern):
    before = dst.clone()
    with pytest.raises(RuntimeError, match=pattern):
        ops.swap_blocks(src, dst, mapping)
    assert_bitwise_equal(dst, before, "swap_blocks: dst after a rejected call")


def test_swap_blocks_mapping_out_of_range(device):
    src = torch.randn(9, 4, 8, device=device)
    dst = torch.full((6, 4, 8), float("nan"))
    expect_swap_error(src, dst, torch.tensor([[0, 0], [9, 1]]), re.escape(
        "swap_blocks: block_mapping[1, 0] = 9 is outside src's 9 blocks"))
    expect_swap_error(src, dst, torch.tensor([[0, 0], [-1, 1]]), re.escape(
        "swap_blocks: block_mapping[1, 0] = -1 is outside src's 9 blocks"))
    expect_swap_error(src, dst, torch.tensor([[0, 0], [1, 6]]), re.escape(
        "swap_blocks: block_mapping[1, 1] = 6 is outside dst's 6 blocks"))


def test_swap_blocks_bad_arguments(device):
    src = torch.randn(9, 4, 8, device=device)
    dst = torch.full((6, 4, 8), float("nan"))
    m = torch.tensor([[0, 1]])
    expect_swap_error(src, dst.half(), m, r"swap_blocks: src is Float but dst is Half")
    expect_swap_error(src, torch.zeros(6, 4, 4), m, re.escape(
        "swap_blocks: src [9, 4, 8] and dst [6, 4, 4] must differ only in the number of "
        "blocks"))
    expect_swap_error(src, dst, m.int(), r"swap_blocks: block_mapping must be Long, got Int")
    expect_swap_error(src, dst, torch.tensor([0, 1]), r"swap_blocks: block_mapping must be 2-D")
    nc = torch.randn(9, 8, 4, device=device).transpose(1, 2)
    expect_swap_error(nc, dst, m, r"swap_blocks: src must be contiguous")


@needs_cuda
def test_swap_blocks_mapping_on_cuda():
    src = torch.randn(9, 4, 8)
    dst = torch.full((6, 4, 8), float("nan"), device="cuda")
    expect_swap_error(src, dst, torch.tensor([[0, 1]], device="cuda"),
                      r"swap_blocks: block_mapping must be on the CPU, got cuda")


# --- CUDA content checks are opt-in ----------------------------------------------------

_UNCHECKED_CUDA_CALLS = """
import torch
from tests.ops.test_bad_inputs import attn, write
from vllm_lite import ops

w = write("cuda")
w.slot_mapping[3] = 10 * 16  # one past the cache: skipped by the kernel, no error
w.call()
torch.cuda.synchronize()
a = attn("cuda")
a.seq_lens[0] = a.max_seq_len + 5  # clamped to the block table, no error
a.block_tables[0, 0] = 10**6       # reads as zeros, no error
a.v1()
a.v2()
kcs = [torch.zeros(4, 8, device="cuda")]
ops.copy_blocks(kcs, [torch.zeros(4, 8, device="cuda")], torch.tensor([[0, 9]], device="cuda"))
torch.cuda.synchronize()
print("unchecked ok")
"""


@needs_cuda
def test_cuda_value_checks_are_opt_in():
    """Without VLLM_LITE_CHECK_VALUES=1 the CUDA launchers skip the content checks (each
    one a device sync) and the kernels' own guards keep every access in bounds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import vllm_lite

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LITE_CHECK_VALUES"}
    # The vllm_lite this test imports (installed in CI, where the checkout has no _C).
    home = str(Path(vllm_lite.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([home, str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _UNCHECKED_CUDA_CALLS], env=env, cwd="/",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "unchecked ok" in r.stdout, r.stderr[-3000:]
