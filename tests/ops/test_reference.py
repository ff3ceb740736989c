"""Self-checks of the reference (reference.py) that need no kernel: it must agree with a
literal per-token loop over the block table and with torch's scaled_dot_product_attention
on contiguous K/V, and the cache builder must poison exactly the slots nobody reads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from .reference import (
    alibi_slopes,
    elem_x,
    make_paged_kv,
    ref_gather_kv,
    ref_paged_attention,
    ref_reshape_and_cache,
)


def _naive(query, kc, vc, num_kv_heads, scale, tables, lens, bs, slopes, k_scale, v_scale):
    """Literal per-token, per-head loops (the spec's wording)."""
    num_seqs, num_heads, d = query.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, d, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        for h in range(num_heads):
            kvh = h // group
            logits, vs = [], []
            for t in range(n):
                blk = int(tables[s][t // bs])
                k = kc[blk, kvh, :, t % bs, :].reshape(d).double()
                lg = scale * k_scale * float(query[s, h].double() @ k)
                if slopes is not None:
                    lg += float(slopes[h]) * (t - n + 1)
                logits.append(lg)
                vs.append(vc[blk, kvh, :, t % bs].double())
            if n == 0:
                continue
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            tot = sum(w)
            out[s, h] = sum(wi / tot * v for wi, v in zip(w, vs)) * v_scale
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alibi", [False, True])
def test_reference_matches_naive_loop(dtype, alibi):
    g = torch.Generator().manual_seed(3)
    lens = [0, 1, 9, 23]
    h, kvh, d, bs = 6, 2, 16, 4
    kv = make_paged_kv(lens, kvh, d, bs, dtype, "cpu", g, table_cols=7)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    slopes = alibi_slopes(h) if alibi else None
    ref, _ = ref_paged_attention(q, kv.key_cache, kv.value_cache, kvh, 0.3, kv.block_tables,
                                 kv.seq_lens, bs, slopes, 1.5, 0.7)
    naive = _naive(q, kv.key_cache, kv.value_cache, kvh, 0.3, kv.block_tables, kv.seq_lens,
                   bs, slopes, 1.5, 0.7)
    torch.testing.assert_close(ref, naive, atol=1e-12, rtol=1e-12)
    assert not ref.isnan().any()


def test_reference_matches_sdpa_and_partitions_recombine():
    g = torch.Generator().manual_seed(4)
    lens = [1300, 7]
    h, kvh, d, bs = 8, 2, 32, 16
    kv = make_paged_kv(lens, kvh, d, bs, torch.float32, "cpu", g)
    q = torch.randn(len(lens), h, d, generator=g)
    slopes = alibi_slopes(h)
    ref, stats = ref_paged_attention(q, kv.key_cache, kv.value_cache, kvh, 0.2,
                                     kv.block_tables, kv.seq_lens, bs, slopes)
    for s, n in enumerate(lens):
        k, v = ref_gather_kv(kv.key_cache, kv.value_cache, kv.block_tables[s], n, bs)
        k = k.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [h, n, d]
        v = v.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        bias = slopes.double()[:, None, None] * (torch.arange(n) - (n - 1)).double()
        want = F.scaled_dot_product_attention(q[s].double()[:, None], k, v, attn_mask=bias,
                                              scale=0.2)[:, 0]
        torch.testing.assert_close(ref[s], want, atol=1e-12, rtol=1e-10)
        # v2's reduction of the partition stats gives the same output.
        st = stats[s]
        gmax = st.max_logits.max(dim=1).values
        w = st.exp_sums * torch.exp(st.max_logits - gmax[:, None])
        comb = (w[:, :, None] * st.tmp_out).sum(1) / w.sum(1)[:, None]
        torch.testing.assert_close(comb, ref[s], atol=1e-12, rtol=1e-10)
    assert stats[0].max_logits.shape == (h, 3) and stats[1].max_logits.shape == (h, 1)


def test_builder_poisons_exactly_the_unread_slots():
    g = torch.Generator().manual_seed(5)
    lens, bs = [5, 16, 0, 33], 8
    kv = make_paged_kv(lens, 2, 16, bs, torch.float16, "cpu", g, table_cols=6)
    x = elem_x(torch.float16)
    assert kv.key_cache.shape[2:] == (16 // x, bs, x)
    finite_k = (~kv.key_cache.isnan()).permute(0, 3, 1, 2, 4).flatten(2).all(-1)
    finite_v = (~kv.value_cache.isnan()).permute(0, 3, 1, 2).flatten(2).all(-1)
    want = torch.zeros_like(finite_k)
    for s, n in enumerate(lens):
        for t in range(n):
            want[int(kv.block_tables[s, t // bs]), t % bs] = True
    assert torch.equal(finite_k, want) and torch.equal(finite_v, want)
    assert kv.key_cache.shape[0] > sum((n + bs - 1) // bs for n in lens)  # spare blocks


def test_ref_reshape_and_cache_matches_loop():
    g = torch.Generator().manual_seed(6)
    n, h, d, bs, nb = 9, 2, 16, 4, 5
    key = torch.randn(n, h, d, generator=g)
    value = torch.randn(n, h, d, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1
    x = elem_x(torch.float32)
    kc = torch.full((nb, h, d // x, bs, x), float("nan"))
    vc = torch.full((nb, h, d, bs), float("nan"))
    rk, rv = ref_reshape_and_cache(key, value, kc, vc, slots, 2.0, 4.0)
    fk = torch.full((nb, bs, h, d), float("nan"))
    rfk, rfv = ref_reshape_and_cache(key, value, fk, fk.clone(), slots, flash=True)
    for i in range(n):
        sl = int(slots[i])
        if sl < 0:
            continue
        b, o = divmod(sl, bs)
        for hh in range(h):
            for dd in range(d):
                assert rk[b, hh, dd // x, o, dd % x] == key[i, hh, dd] / 2.0
                assert rv[b, hh, dd, o] == value[i, hh, dd] / 4.0
                assert rfk[b, o, hh, dd] == key[i, hh, dd]
                assert rfv[b, o, hh, dd] == value[i, hh, dd]
    assert int((~rk.isnan()).sum()) == (n - 1) * h * d
