"""vllm_lite.compat.vllm against a suite in the shape of vLLM's own kernel tests: vLLM's
grids (heads (40, 40) and (64, 8), its head and block sizes, ALiBi on and off, auto and fp8
caches), its reference (scores in the query dtype, softmax in float32 cast to the value
dtype) and its tolerances (atol 1e-3, rtol 1e-5; fp8 1e-2). Code written against vLLM's
_custom_ops is called the way vLLM calls it (k_scale / v_scale as 1-element tensors).

Backends: "cpu", "cuda" (with a GPU) and "emulated": CPU tensors, with the torch.ops calls
the compat layer makes run by the CUDA kernels on the SIMT emulator (tests/compat/emulated.py),
so the compat argument mapping + the CUDA kernels are checked without a GPU. The emulator
runs each GPU thread as a fiber under ASan, so its attention cases are shorter (fewer and
shorter sequences, the longest still crossing a v2 partition); the rest is the same.

A representative slice runs by default; --full-grid runs vLLM's whole grid."""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch

from vllm_lite.compat import vllm as ops

from .emulated import emulated_ops

NUM_HEADS = [(40, 40), (64, 8)]
HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
BLOCK_SIZES = [16, 32]
DTYPES = [torch.half, torch.bfloat16, torch.float]
KV_CACHE_DTYPES = ["auto", "fp8"]
NUM_SEQS = 7
MAX_SEQ_LEN = 4096  # vllm_lite's kernels have no length limit (v2 partitions any length)
PARTITION_SIZE = 512


# The emulated attention cases' sizes (see the module docstring).
EMULATED_NUM_SEQS = 3
EMULATED_MAX_SEQ_LEN = PARTITION_SIZE + 37
# The emulated default slice: MHA and GQA, head sizes 64 / 80 / 128, both block sizes,
# ALiBi on and off, auto and fp8 caches, every dtype, v1 and v2.
EMULATED_DEFAULT = {
    ("v1", (40, 40), 64, 16, False, torch.half, "auto"),
    ("v2", (64, 8), 128, 32, True, torch.bfloat16, "fp8"),
    ("v2", (40, 40), 80, 32, True, torch.float, "auto"),
    ("v1", (64, 8), 80, 16, False, torch.bfloat16, "fp8"),
}


def _devices() -> list:
    """cpu, cuda (where there is a GPU) and emulated (marked cuda_emulated)."""
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else []),
            pytest.param("emulated", marks=pytest.mark.cuda_emulated)]


def _torch_device(device: str) -> str:
    return "cpu" if device == "emulated" else device


def _kernels(device: str) -> contextlib.AbstractContextManager:
    """Where the compat calls' ops run: the emulated CUDA kernels for "emulated", else the
    tensors' device's kernels."""
    return emulated_ops() if device == "emulated" else contextlib.nullcontext()


def _grid() -> list:
    full = list(itertools.product(["v1", "v2"], NUM_HEADS, HEAD_SIZES, BLOCK_SIZES, [False, True],
                                  DTYPES, KV_CACHE_DTYPES))
    rng = random.Random(1234)  # a fixed slice of the grid, so the default run is stable
    default = {full.index(c) for c in rng.sample(full, 6)}
    # Every head size, dtype and cache kind appears at least once in the default slice.
    for i, c in enumerate(full):
        if c[2] in (80, 256) and c[6] == "fp8" and c[4]:
            default.add(i)
            break
    assert EMULATED_DEFAULT <= set(full)

    def param(device, c, marks):
        v, (h, kvh), d, bs, alibi, dt, kv = c
        name = f"{device}-{v}-h{h}k{kvh}-d{d}-b{bs}{'-alibi' if alibi else ''}-{dt}-{kv}"
        return pytest.param(device, *c, marks=marks, id=name.replace("torch.", ""))

    params = []
    for device in ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]:
        params += [param(device, c, () if i in default else pytest.mark.full_grid)
                   for i, c in enumerate(full)]
    params += [param("emulated", c, [pytest.mark.cuda_emulated] + (
        [] if c in EMULATED_DEFAULT else [pytest.mark.full_grid])) for c in full]
    return params


def _kv_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
               dtype: torch.dtype, kv_cache_dtype: str, device: str, gen: torch.Generator,
               used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random caches in vLLM's layouts, filled as vLLM's create_kv_caches_with_random does
    (uniform in [-scale, scale] with scale = head_size**-0.5; fp8 caches hold those values
    rounded to fp8) in the blocks ``used`` names (those that hold some sequence's tokens);
    every other block is NaN, so a kernel reading past a sequence's blocks shows."""
    scale = head_size ** -0.5
    x = 16 // torch.empty((), dtype=dtype).element_size()
    if kv_cache_dtype == "fp8":
        x = 16
    kshape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    vshape = (num_blocks, num_kv_heads, head_size, block_size)
    caches = []
    for shape in (kshape, vshape):
        values = torch.full(shape, float("nan"))
        values[used] = torch.empty((len(used), *shape[1:])).uniform_(-scale, scale,
                                                                     generator=gen)
        if kv_cache_dtype == "fp8":
            caches.append(values.to(torch.float8_e4m3fn).view(torch.uint8).to(device))
        else:
            caches.append(values.to(dtype).to(device))
    return caches[0], caches[1]


def _ref_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi,
                   kv_cache_dtype, dtype, k_scale, v_scale):
    """vLLM's reference: per sequence, gather K / V token by token through the block
    table, scores in the query dtype, ALiBi bias, softmax in float32 cast to the value
    dtype, then the weighted sum of values."""
    num_kv_heads, head_size = value_cache.shape[1], value_cache.shape[2]
    block_size = value_cache.shape[3]
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        n = int(seq_lens[i])
        pos = torch.arange(n)
        blocks, offs = block_tables[i, pos // block_size].long(), pos % block_size
        k = key_cache[blocks, :, :, offs, :].reshape(n, num_kv_heads, head_size)
        v = value_cache[blocks, :, :, offs]  # [n, kv, d]
        if kv_cache_dtype == "fp8":
            k = k.view(torch.float8_e4m3fn).to(dtype) * k_scale
            v = v.view(torch.float8_e4m3fn).to(dtype) * v_scale
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[i:i + 1]
        # einsum in the query dtype as vLLM's GPU reference runs it: products accumulated
        # in float32, the result rounded to the dtype (computed here in float32 and then
        # rounded: the CPU's half-precision einsum is orders of magnitude slower).
        weights = (scale * torch.einsum("qhd,khd->hqk", q.float(), k.float()).to(q.dtype)
                   ).float()
        if alibi is not None:
            pos = torch.arange(n, device=q.device)
            weights = weights + (alibi.view(-1, 1, 1) * (pos - n + 1).float().view(1, 1, -1))
        weights = torch.softmax(weights, dim=-1).to(v.dtype)
        out[i] = torch.einsum("hqk,khd->qhd", weights.float(), v.float())[0].to(v.dtype)
    return out


@pytest.mark.parametrize(
    "device,version,num_heads,head_size,block_size,use_alibi,dtype,kv_cache_dtype", _grid())
def test_paged_attention(device, version, num_heads, head_size, block_size, use_alibi, dtype,
                         kv_cache_dtype) -> None:
    _check_paged_attention(device, version, num_heads, head_size, block_size, use_alibi, dtype,
                           kv_cache_dtype)


# vLLM's inputs keep the logits tiny (|q.k| * scale about 1e-2), so the softmax is nearly
# flat and a wrong softmax scale or k_scale is invisible at its tolerance. These cases make
# the logits order 1 (query uniform in +-3 sqrt(head_size)) and pass k_scale != v_scale:
# applied to fp8 caches, ignored for "auto" ones (vLLM's meaning). float16 / float32
# queries: scores rounded to bfloat16 (the reference's) would dominate the tolerance.
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("version,num_heads,head_size,block_size,use_alibi,dtype,kv_cache_dtype", [
    ("v1", (64, 8), 128, 16, False, torch.half, "fp8"),
    ("v2", (40, 40), 64, 32, True, torch.half, "auto"),
    ("v2", (64, 8), 80, 16, False, torch.float, "fp8"),
])
def test_paged_attention_scales(device, version, num_heads, head_size, block_size, use_alibi,
                                dtype, kv_cache_dtype) -> None:
    _check_paged_attention(device, version, num_heads, head_size, block_size, use_alibi, dtype,
                           kv_cache_dtype, query_range=3 * head_size ** 0.5, k_scale=0.75,
                           v_scale=1.5)


def _check_paged_attention(device, version, num_heads, head_size, block_size, use_alibi, dtype,
                           kv_cache_dtype, query_range=None, k_scale=1.0, v_scale=1.0) -> None:
    """vLLM's test_paged_attention: random inputs as vLLM draws them (the query uniform in
    +-query_range, default vLLM's 1 / sqrt(head_size)), the compat call, vLLM's reference."""
    seed = random.randrange(1 << 31)
    gen = torch.Generator().manual_seed(seed)
    num_seqs, longest = ((EMULATED_NUM_SEQS, EMULATED_MAX_SEQ_LEN) if device == "emulated"
                         else (NUM_SEQS, MAX_SEQ_LEN))
    backend, device = device, _torch_device(device)
    num_query_heads, num_kv_heads = num_heads
    scale = float(1.0 / head_size ** 0.5)
    query_range = scale if query_range is None else query_range
    query = torch.empty(num_seqs, num_query_heads, head_size, dtype=torch.float32)
    query = query.uniform_(-query_range, query_range, generator=gen).to(dtype).to(device)
    alibi = (torch.randn(num_query_heads, generator=gen).to(device) if use_alibi else None)
    seq_lens = torch.randint(1, longest + 1, (num_seqs,), generator=gen)
    seq_lens[-1] = longest
    max_seq_len = int(seq_lens.max())
    blocks_per_seq = (max_seq_len + block_size - 1) // block_size
    num_blocks = num_seqs * blocks_per_seq
    block_tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_seq]
    block_tables = block_tables.view(num_seqs, blocks_per_seq).to(torch.int32).to(device)
    # The blocks each sequence's length reaches; the rest of its table (up to the longest
    # sequence) is NaN in the caches.
    used = torch.cat([block_tables[i, :(int(n) + block_size - 1) // block_size].cpu().long()
                      for i, n in enumerate(seq_lens)])
    key_cache, value_cache = _kv_caches(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                        kv_cache_dtype, device, gen, used)
    # vLLM passes the scales as 1-element float32 tensors.
    k_scale_t = torch.tensor(k_scale, dtype=torch.float32, device=device)
    v_scale_t = torch.tensor(v_scale, dtype=torch.float32, device=device)
    seq_lens_d = seq_lens.to(torch.int32).to(device)
    out = torch.full_like(query, float("nan"))
    parts = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    tmp_out = torch.full((num_seqs, num_query_heads, parts, head_size), float("nan"),
                         dtype=dtype, device=device)
    exp_sums = torch.full((num_seqs, num_query_heads, parts), float("nan"), dtype=torch.float32,
                          device=device)
    max_logits = torch.full_like(exp_sums, float("nan"))
    # vLLM's fp8 key cache has 16-element chunks: vllm_lite refuses head sizes that leave a
    # partial one (120 in vLLM's grid). The emulator replays no argument checks (its cases
    # are ones the op takes), so there the refusal is the CPU / CUDA cases' to check.
    refused = kv_cache_dtype == "fp8" and head_size % 16 != 0
    if refused and backend == "emulated":
        pytest.skip(f"head_size {head_size} with an fp8 cache is refused by the op")
    with (pytest.raises(RuntimeError, match="multiple of 16") if refused
          else contextlib.nullcontext()), _kernels(backend):
        if version == "v1":
            ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                                   block_tables, seq_lens_d, block_size, max_seq_len, alibi,
                                   kv_cache_dtype, k_scale_t, v_scale_t)
        else:
            ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache,
                                   value_cache, num_kv_heads, scale, block_tables, seq_lens_d,
                                   block_size, max_seq_len, alibi, kv_cache_dtype, k_scale_t,
                                   v_scale_t)
    if refused:
        assert out.isnan().all(), "a refused call must not write"
        return
    # vLLM's meaning: the scales apply to fp8 caches only.
    ks, vs = (k_scale, v_scale) if kv_cache_dtype == "fp8" else (1.0, 1.0)
    ref = _ref_attention(query.cpu(), key_cache.cpu(), value_cache.cpu(), block_tables.cpu(),
                         seq_lens, scale, None if alibi is None else alibi.cpu(),
                         kv_cache_dtype, dtype, ks, vs)
    atol, rtol = (1e-2, 1e-5) if kv_cache_dtype == "fp8" else (1e-3, 1e-5)
    torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=rtol,
                               msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", ["split", "flash"])
def test_reshape_and_cache(device: str, kv_cache_dtype: str, layout: str) -> None:
    backend, device = device, _torch_device(device)
    seed = random.randrange(1 << 31)
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, head_size, block_size, num_blocks = 42, 8, 128, 16, 64
    dtype = torch.bfloat16
    key = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    store = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    x = 16 if kv_cache_dtype == "fp8" else 8
    if layout == "split":
        kshape = (num_blocks, num_heads, head_size // x, block_size, x)
        vshape = (num_blocks, num_heads, head_size, block_size)
    else:
        kshape = vshape = (num_blocks, block_size, num_heads, head_size)
    key_cache = torch.zeros(kshape, dtype=store, device=device)
    value_cache = torch.zeros(vshape, dtype=store, device=device)
    k_scale = torch.tensor(0.5, dtype=torch.float32, device=device)
    v_scale = 2.0  # older vLLM: floats
    fn = ops.reshape_and_cache if layout == "split" else ops.reshape_and_cache_flash
    with _kernels(backend):
        fn(key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale)
    for i, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, block_size)
        if layout == "split":
            k_got = key_cache[b, :, :, o, :].reshape(num_heads, head_size)
            v_got = value_cache[b, :, :, o]
        else:
            k_got, v_got = key_cache[b, o], value_cache[b, o]
        if kv_cache_dtype == "fp8":
            k_want = (key[i].float() / 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
            v_want = (value[i].float() / 2.0).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            k_want, v_want = key[i], value[i]
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), f"seed {seed}, token {i}"


@pytest.mark.parametrize("device", _devices())
def test_copy_and_swap_blocks(device: str) -> None:
    backend, device = device, _torch_device(device)
    gen = torch.Generator().manual_seed(random.randrange(1 << 31))
    shape = (16, 4, 8, 16, 8)
    keys = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    values = [torch.randn(16, 4, 64, 16, generator=gen).to(device) for _ in range(2)]
    before = [c.clone() for c in keys + values]
    mapping = torch.tensor([[0, 5], [3, 9], [7, 2]], dtype=torch.int64, device=device)
    with _kernels(backend):
        ops.copy_blocks(keys, values, mapping)
    for c, b in zip(keys + values, before):
        for src, dst in mapping.tolist():
            assert torch.equal(c[dst], b[src])
        untouched = [i for i in range(16) if i not in mapping[:, 1].tolist()]
        assert torch.equal(c[untouched], b[untouched])
    dst = torch.zeros_like(keys[0], device="cpu")
    with _kernels(backend):
        ops.swap_blocks(keys[0], dst, torch.tensor([[1, 4], [2, 0]], dtype=torch.int64))
    assert torch.equal(dst[4], keys[0][1].cpu()) and torch.equal(dst[0], keys[0][2].cpu())
    assert dst[1].abs().sum() == 0


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_convert_fp8_round_trip(kv_dtype: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 31))
    src = (torch.randn(4, 8, 16, generator=gen) * 3).to(dtype)
    fp8 = torch.full(src.shape, 0x7F, dtype=torch.uint8)
    ops.convert_fp8(fp8, src, 0.5, kv_dtype)
    torch_fp8 = torch.float8_e5m2 if kv_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    assert torch.equal(fp8, (src.float() / 0.5).to(torch_fp8).view(torch.uint8))
    back = torch.full(src.shape, float("nan"), dtype=dtype)
    ops.convert_fp8(back, fp8, 0.5, kv_dtype)
    assert torch.equal(back, (fp8.view(torch_fp8).float() * 0.5).to(dtype))


def test_bad_arguments_are_refused() -> None:
    q = torch.zeros(1, 8, 64)
    kc, vc = torch.zeros(2, 8, 16, 16, 4), torch.zeros(2, 8, 64, 16)
    args = (torch.zeros_like(q), q, kc, vc, 8, 0.125, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 16, 1, None, "auto")
    for name, value in [("blocksparse_vert_stride", 4), ("blocksparse_local_blocks", 2),
                        ("blocksparse_block_size", 32), ("blocksparse_head_sliding_step", 1)]:
        with pytest.raises(ValueError, match=name):
            ops.paged_attention_v1(*args, 1.0, 1.0, **{name: value})
    ops.paged_attention_v1(*args, 1.0, 1.0, tp_rank=3)  # dense: any rank is fine
    with pytest.raises(ValueError, match="k_scale"):
        ops.paged_attention_v1(*args, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="v_scale"):
        ops.paged_attention_v1(*args, 1.0, "1.0")
    with pytest.raises(ValueError, match="kv_dtype"):
        ops.convert_fp8(torch.zeros(4, dtype=torch.uint8), torch.zeros(4), 1.0, "auto")
    with pytest.raises(ValueError, match="shape"):
        ops.convert_fp8(torch.zeros(4, dtype=torch.uint8), torch.zeros(5), 1.0, "fp8")
