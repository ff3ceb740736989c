"""Plain-PyTorch reference for the vllm_lite kernels, plus builders for test inputs.

The reference never uses the kernels' own code paths or layout helpers: it reads K and V
through the block table token by token (block = table[t // block_size], offset =
t % block_size), in float64, from the very (rounded) values the kernel sees.

Layouts (csrc/ops.h, vLLM v0.6):
  key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 bytes / elem
  value_cache [num_blocks, num_kv_heads, head_size, block_size]
  flash       [num_blocks, block_size, num_kv_heads, head_size] (K and V)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PARTITION_SIZE = 512  # tokens per paged_attention_v2 partition (independent of vllm_lite.ops)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tolerances (atol, rtol) per dtype, used for attention outputs, v2's tmp_out, max_logits
# and exp_sums. They compare the kernel with a float64 reference computed from the same
# rounded inputs, so they only have to absorb the kernel's own arithmetic: float32
# accumulation, the output's rounding to the dtype (fp16: 2^-11, bf16: 2^-8 relative),
# probabilities rounded to the dtype before the V product, and for v2 tmp_out's rounding
# to the dtype before the partitions are combined.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def elem_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk (computed here, not taken from vllm_lite.ops)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------
# Bitwise comparison (NaN == NaN when the bits agree).


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t
    return t.view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        ac, ec = actual.detach().cpu(), expected.detach().cpu()
        if ac.is_floating_point():
            diff = ~((ac == ec) | (ac.isnan() & ec.isnan()))
        else:
            diff = ac != ec
        idx = diff.nonzero()
        first = tuple(idx[0].tolist()) if len(idx) else None
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {ac.numel()} elements differ bitwise; first at "
            f"{first}: got {ac[first].item() if first else '?'}, "
            f"expected {ec[first].item() if first else '?'}"
        )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    torch.testing.assert_close(
        actual.detach().cpu().to(torch.float64),
        expected.detach().cpu().to(torch.float64),
        **tol(dtype),
        msg=lambda m: f"{what} ({dtype_name(dtype)}): {m}",
    )


# ---------------------------------------------------------------------------------------
# Attention reference.


@dataclass
class PartitionStats:
    """Per sequence: [num_heads, num_partitions(seq)] and [..., head_size]."""

    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    tmp_out: torch.Tensor


def ref_gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seq_len, num_kv_heads, head_size] of one sequence, read token by token
    through its block table row (vectorized over the tokens)."""
    t = torch.arange(seq_len)
    blk = table_row.cpu().long()[t // block_size]
    off = t % block_size
    kc, vc = key_cache.cpu(), value_cache.cpu()
    if kc.dim() == 4:  # flash layout: [num_blocks, block_size, num_kv_heads, head_size]
        return kc[blk, off], vc[blk, off]
    num_kv_heads = kc.shape[1]
    head_size = kc.shape[2] * kc.shape[4]
    # Advanced indices at dims 0 and 3 of K ([t] and [t]) go first: [T, kvh, D/x, x].
    k = kc[blk, :, :, off, :].reshape(seq_len, num_kv_heads, head_size)
    v = vc[blk, :, :, off]  # [T, kvh, D]
    return k, v


def split_to_flash(key_cache: torch.Tensor, value_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same caches (NaN-poisoned slots included) in the flash layout [num_blocks,
    block_size, num_kv_heads, head_size], contiguous."""
    nb, kvh, dx, bs, x = key_cache.shape
    k = key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, kvh, dx * x).contiguous()
    v = value_cache.permute(0, 3, 1, 2).contiguous()
    return k, v


class single_thread:
    """Runs the reference's many small tensor ops on one intra-op thread: with OpenMP on a
    busy machine, two threads make each small op many times slower (barrier spinning)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def ref_paged_attention(*args, **kwargs) -> tuple[torch.Tensor, list[PartitionStats]]:
    with single_thread():
        return _ref_paged_attention(*args, **kwargs)


def _ref_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition_size: int = PARTITION_SIZE,
) -> tuple[torch.Tensor, list[PartitionStats]]:
    """Returns out [num_seqs, num_heads, head_size] (float64) and v2's per-partition stats.

    logit[t] = scale * k_scale * q . K[t] + slope * (t - seq_len + 1); out = softmax @ V *
    v_scale; seq_len 0 gives zeros and no partitions.
    """
    num_seqs, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    q_all = query.detach().cpu().to(torch.float64)
    slopes = None if alibi_slopes is None else alibi_slopes.cpu().to(torch.float64)
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    stats: list[PartitionStats] = []
    for s in range(num_seqs):
        seq_len = int(seq_lens[s])
        if seq_len == 0:
            stats.append(
                PartitionStats(
                    torch.empty(num_heads, 0, dtype=torch.float64),
                    torch.empty(num_heads, 0, dtype=torch.float64),
                    torch.empty(num_heads, 0, head_size, dtype=torch.float64),
                )
            )
            continue
        k, v = ref_gather_kv(key_cache, value_cache, block_tables[s], seq_len, block_size)
        k = k.to(torch.float64)
        v = v.to(torch.float64)
        q = q_all[s].view(num_kv_heads, group, head_size)
        logits = torch.einsum("kgd,tkd->kgt", q, k).reshape(num_heads, seq_len)
        logits = logits * (scale * k_scale)
        if slopes is not None:
            pos = torch.arange(seq_len, dtype=torch.float64) - (seq_len - 1)
            logits = logits + slopes[:, None] * pos[None, :]
        probs = torch.softmax(logits, dim=-1).view(num_kv_heads, group, seq_len)
        out[s] = torch.einsum("kgt,tkd->kgd", probs, v).reshape(num_heads, head_size) * v_scale

        parts = (seq_len + partition_size - 1) // partition_size
        ml = torch.empty(num_heads, parts, dtype=torch.float64)
        es = torch.empty(num_heads, parts, dtype=torch.float64)
        to = torch.empty(num_heads, parts, head_size, dtype=torch.float64)
        for p in range(parts):
            lo, hi = p * partition_size, min((p + 1) * partition_size, seq_len)
            lg = logits[:, lo:hi]
            m = lg.max(dim=-1).values
            e = torch.exp(lg - m[:, None])
            ssum = e.sum(dim=-1)
            w = (e / ssum[:, None]).view(num_kv_heads, group, hi - lo)
            ml[:, p] = m
            es[:, p] = ssum
            to[:, p] = (
                torch.einsum("kgt,tkd->kgd", w, v[lo:hi]).reshape(num_heads, head_size) * v_scale
            )
        stats.append(PartitionStats(ml, es, to))
    return out, stats


def ref_varlen_paged_attention(*args, **kwargs) -> torch.Tensor:
    with single_thread():
        return _ref_varlen_paged_attention(*args, **kwargs)


def _ref_varlen_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out [num_tokens, num_heads, head_size] (float64) of varlen_paged_attention.

    Sequence i's queries are rows query_start_loc[i]:query_start_loc[i + 1]; query j of n
    sits at position p = seq_len - n + j and attends to positions 0..p: logit[t] = scale *
    k_scale * q . K[t] + slope * (t - p); out = softmax @ V * v_scale. Computed as a full
    [n, seq_len] logit matrix with masked entries -inf, per KV head group.
    """
    num_tokens, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    q_all = query.detach().cpu().to(torch.float64)
    starts = [int(x) for x in query_start_loc.cpu()]
    slopes = None if alibi_slopes is None else alibi_slopes.cpu().to(torch.float64)
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    for s in range(len(starts) - 1):
        lo, hi = starts[s], starts[s + 1]
        n, seq_len = hi - lo, int(seq_lens[s])
        if n == 0:
            continue
        k, v = ref_gather_kv(key_cache, value_cache, block_tables[s], seq_len, block_size)
        k, v = k.to(torch.float64), v.to(torch.float64)
        q = q_all[lo:hi].view(n, num_kv_heads, group, head_size)
        logits = torch.einsum("nkgd,tkd->nkgt", q, k) * (scale * k_scale)
        qpos = torch.arange(n, dtype=torch.float64) + (seq_len - n)
        tpos = torch.arange(seq_len, dtype=torch.float64)
        if slopes is not None:
            bias = tpos[None, :] - qpos[:, None]  # [n, t]
            logits = logits + slopes.view(num_kv_heads, group)[None, :, :, None] * bias[:, None, None, :]
        masked = (tpos[None, :] > qpos[:, None])[:, None, None, :]
        logits = logits.masked_fill(masked, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        o = torch.einsum("nkgt,tkd->nkgd", probs, v) * v_scale
        out[lo:hi] = o.reshape(n, num_heads, head_size)
    return out


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes (as vLLM computes them), float32."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        n = min(closest, num_heads - closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(n)]
    return torch.tensor(slopes, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Paged KV cache builder.


@dataclass
class PagedKV:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_size: int
    num_kv_heads: int
    head_size: int
    used_blocks: list[int] = field(default_factory=list)


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    gen: torch.Generator,
    *,
    table_cols: int | None = None,
    pool_slack: int | None = None,
    unused_table_fill: str = "nan_block",
    value_scale: float = 1.0,
) -> PagedKV:
    """Random K/V for each sequence in a shuffled pool of blocks.

    The pool has more blocks than the sequences need; the block ids come from a
    torch.randperm of the pool. Every slot that no sequence reads (the tail of each last
    block and every block no table names within its length) is NaN. Table columns past a
    sequence's last block hold ``unused_table_fill``: "nan_block" (ids of NaN-filled
    blocks), "garbage" (ids far outside the pool, negative or huge) or "zero".
    """
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    total = sum(need)
    if pool_slack is None:
        pool_slack = max(2, total // 3)
    num_blocks = total + pool_slack
    if table_cols is None:
        table_cols = max(need + [1])
    assert table_cols >= max(need + [0])
    x = elem_x(dtype)
    kc = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x, generator=gen)
    vc = torch.randn(num_blocks, num_kv_heads, head_size, block_size, generator=gen)
    kc, vc = kc.to(dtype), (vc * value_scale).to(dtype)

    perm = torch.randperm(num_blocks, generator=gen).tolist()
    used_ids, spare_ids = perm[:total], perm[total:]
    tables = torch.empty(len(seq_lens), table_cols, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    pos = 0
    for s, (n, nb) in enumerate(zip(seq_lens, need)):
        ids = used_ids[pos : pos + nb]
        pos += nb
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        rest = table_cols - nb
        if rest:
            if unused_table_fill == "nan_block":
                fill = torch.tensor(spare_ids, dtype=torch.int32)[
                    torch.randint(len(spare_ids), (rest,), generator=gen)
                ]
            elif unused_table_fill == "garbage":
                choices = torch.tensor([-1, -(2**31), 2**31 - 1, num_blocks, 10**6],
                                       dtype=torch.int32)
                fill = choices[torch.randint(len(choices), (rest,), generator=gen)]
            elif unused_table_fill == "zero":
                fill = torch.zeros(rest, dtype=torch.int32)
            else:
                raise ValueError(unused_table_fill)
            tables[s, nb:] = fill
        for b, blk in enumerate(ids):
            used[blk, : min(block_size, n - b * block_size)] = True
    # Poison every slot no sequence reads.
    kc.permute(0, 3, 1, 2, 4)[~used] = float("nan")
    vc.permute(0, 3, 1, 2)[~used] = float("nan")
    return PagedKV(
        key_cache=kc.to(device),
        value_cache=vc.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        used_blocks=used_ids,
    )


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def num_partitions(max_seq_len: int) -> int:
    return max(1, (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE)


# ---------------------------------------------------------------------------------------
# Cache-write reference.


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    flash: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns copies of the caches (on the CPU) after the write; negative slots skipped.

    The cache holds key / k_scale rounded once to the cache dtype (computed in float64).
    """
    kc, vc = key_cache.detach().cpu().clone(), value_cache.detach().cpu().clone()
    slots = slot_mapping.cpu()
    keep = slots >= 0
    slots = slots[keep]
    k = key.detach().cpu()[keep]
    v = value.detach().cpu()[keep]
    if k_scale != 1.0:
        k = (k.to(torch.float64) / k_scale).to(key.dtype)
    if v_scale != 1.0:
        v = (v.to(torch.float64) / v_scale).to(value.dtype)
    n, h, d = k.shape
    if flash:
        bs = kc.shape[1]
        blk, off = slots // bs, slots % bs
        kc[blk, off] = k
        vc[blk, off] = v
    else:
        bs = kc.shape[3]
        x = kc.shape[4]
        blk, off = slots // bs, slots % bs
        kc[blk, :, :, off, :] = k.reshape(n, h, d // x, x)
        vc[blk, :, :, off] = v
    return kc, vc


# -- fp8 KV caches --------------------------------------------------------------------------
#: torch's float8 dtype of each fp8 kv_cache_dtype ("fp8" = e4m3).
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def fp8_bytes(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """torch's cast of x / scale (float32 division, as a float32 tensor divided by the
    scale) to the fp8 dtype, as uint8: what reshape_and_cache must store."""
    q = x.float() / torch.tensor(scale, dtype=torch.float32)
    return q.to(FP8_DTYPES[kv_cache_dtype]).view(torch.uint8)


def to_fp8_caches(kv, kv_cache_dtype: str, k_scale: float, v_scale: float):
    """make_paged_kv's float caches (x = 4, float32) as fp8 caches (x = 16) holding key /
    k_scale and value / v_scale, and their dequantized float64 values (stored value x scale,
    x = 16 layout). NaN slots stay NaN bytes."""
    kc, vc = kv.key_cache, kv.value_cache
    nb, h, _, bs, _ = kc.shape
    d = kv.head_size
    rows = kc.permute(0, 1, 3, 2, 4).reshape(nb, h, bs, d)  # token rows
    k16 = rows.reshape(nb, h, bs, d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    k8, v8 = fp8_bytes(k16, kv_cache_dtype, k_scale), fp8_bytes(vc, kv_cache_dtype, v_scale)
    fp8 = FP8_DTYPES[kv_cache_dtype]
    return (k8, v8, k8.view(fp8).to(torch.float64) * k_scale,
            v8.view(fp8).to(torch.float64) * v_scale)


def assert_rounded_once_to_bf16(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """y (bfloat16) is ref (float64) rounded once to bfloat16, but for float32 accumulation
    in another order (rtol x max |ref|): each element within half a bf16 step of ref plus
    that, and >= 99% of them exactly ref's rounding (rounding a weight or a partial sum to
    bf16 on the way would miss both)."""
    assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
    acc_err = rtol * float(ref.abs().max()) + 1e-7
    step = ref.abs().to(torch.bfloat16).double()  # |ref| rounded: its bf16 step is /128
    err = (y.double() - ref).abs()
    assert bool((err <= step / 256 * 1.01 + acc_err).all()), float((err - step / 256).max())
    exact = (y == ref.to(torch.bfloat16)).double().mean().item()
    assert exact >= 0.99, exact
