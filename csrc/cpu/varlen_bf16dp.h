// The bfloat16 varlen (prefill) task of the AVX512-BF16 build: the grid, scratch, online
// softmax and output of varlen_task (varlen_attention_kernel.h), with both products on
// vdpbf16ps (a pair of bf16 products per lane, accumulated in float32) instead of float32
// FMAs on converted K and V: half the instructions per product.
//   1. The chunk's keys are copied, not converted, as K [token, head dim] and its values as
//      V [head dim, token] (bf16): a pair (K[t, d], K[t, d + 1]) or (V[d, t], V[d, t + 1])
//      is one 32-bit broadcast.
//   2. P^T [token, row] = K q^T on q^T kept as bf16 pairs [head dim / 2, row, 2] (the query
//      exactly, unscaled; the scale multiplies the float32 sums): 4 tokens x 4 row vectors
//      of 16 rows per pair of dims.
//   3. The softmax of varlen_task on the float32 scores.
//   4. acc^T [head dim, row] += V P^T with the probabilities rounded to bf16 pairs
//      [token / 2, row, 2] (as FlashAttention and Hugging Face's eager attention round them
//      before the PV product), in place over P^T: 4 dims x 4 row vectors per pair of tokens.
// Limits as varlen_task (the copies make any block size's token pairs adjacent).
#pragma once

#include <immintrin.h>

#include "cpu/bf16_pairs.h"

namespace vllm_lite::cpu {
namespace {

// pt[t + i, r..] = scale * sum_d k[t + i, d] q[r.., d] for i < 4 and NR row vectors from r;
// qb: [dp / 2, rp, 2] bf16, k: [token, dp] bf16.
template <int64_t NR>
VLLM_LITE_INLINE void scores_block_bf16(const uint16_t* k, const uint16_t* qb, int64_t dp,
                                        int64_t rp, float scale, float* pt, int64_t t,
                                        int64_t r) {
  __m512 acc[kBlock4][NR];
  for (int64_t i = 0; i < kBlock4; ++i) {
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < dp; d += 2) {
    __m512bh q[NR];
    for (int64_t j = 0; j < NR; ++j) {
      q[j] = (__m512bh)_mm512_loadu_si512(qb + (d / 2 * rp + r + j * 16) * 2);
    }
    for (int64_t i = 0; i < kBlock4; ++i) {
      const __m512bh kv = bcast_pair(k + (t + i) * dp + d);
      for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], q[j], kv);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kBlock4; ++i) {
    for (int64_t j = 0; j < NR; ++j) {
      _mm512_storeu_ps(pt + (t + i) * rp + r + j * 16, _mm512_mul_ps(acc[i][j], s));
    }
  }
}

// acct[d + i, r..] = acct * alpha[r..] + sum_t v[d + i, t] p[t, r..], i < 4, over npairs
// token pairs; pb: [token / 2, rp, 2] bf16, v: [dp, chunk] bf16.
template <int64_t NR>
VLLM_LITE_INLINE void values_block_bf16(const uint16_t* v, const uint16_t* pb,
                                        const float* alpha, int64_t rp, int64_t npairs,
                                        float* acct, int64_t d, int64_t r) {
  constexpr int64_t C = kVarlenKvChunk;
  __m512 acc[kBlock4][NR];
  for (int64_t j = 0; j < NR; ++j) {
    const __m512 a = _mm512_loadu_ps(alpha + r + j * 16);
    for (int64_t i = 0; i < kBlock4; ++i) {
      acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acct + (d + i) * rp + r + j * 16), a);
    }
  }
  for (int64_t tp = 0; tp < npairs; ++tp) {
    __m512bh pv[NR];
    for (int64_t j = 0; j < NR; ++j) {
      pv[j] = (__m512bh)_mm512_loadu_si512(pb + (tp * rp + r + j * 16) * 2);
    }
    for (int64_t i = 0; i < kBlock4; ++i) {
      const __m512bh vv = bcast_pair(v + (d + i) * C + 2 * tp);
      for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pv[j], vv);
    }
  }
  for (int64_t i = 0; i < kBlock4; ++i) {
    for (int64_t j = 0; j < NR; ++j) _mm512_storeu_ps(acct + (d + i) * rp + r + j * 16, acc[i][j]);
  }
}

void varlen_task_bf16dp(const VarlenParams& p, int64_t task, float* scratch) {
  constexpr int64_t X = 8;  // bf16 per 16-byte chunk of the key cache
  constexpr int64_t C = kVarlenKvChunk;
  static_assert(C % 2 == 0 && VW == 16, "token pairs; 16-lane row vectors");

  // The scratch sections of varlen_task, each used at half its size or less: qb
  // [Dp / 2, rp, 2] bf16 in q^T's, K [C, Dp] and V [Dp, C] bf16 in theirs, P^T float32
  // and then its bf16 pairs in P^T's.
  VarlenTile g(p, task, scratch);
  const int64_t D = g.D, Dp = g.Dp, bs = g.bs, rows = g.rows, rp = g.rp;
  const uint16_t* kc = static_cast<const uint16_t*>(p.key_cache) + g.kh * D * bs;
  const uint16_t* vc = static_cast<const uint16_t*>(p.value_cache) + g.kh * D * bs;
  uint16_t* qb = reinterpret_cast<uint16_t*>(g.qt);
  uint16_t* k = reinterpret_cast<uint16_t*>(g.k);
  uint16_t* v = reinterpret_cast<uint16_t*>(g.v);
  float* pt = g.pt;
  uint16_t* pb = reinterpret_cast<uint16_t*>(pt);

  // q^T as bf16 pairs: pair i of row r (dims 2i, 2i + 1) is the 32-bit word i * rp + r,
  // copied as one (element by element, the index arithmetic cost more than the copy).
  uint32_t* qb32 = reinterpret_cast<uint32_t*>(qb);
  for (int64_t r = 0; r < rp; ++r) {
    int64_t i = 0;
    if (r < rows) {
      const uint16_t* qrow = static_cast<const uint16_t*>(p.query) +
                             g.token(r) * p.q_stride_token + g.head(r) * p.q_stride_head;
      for (; i < D / 2; ++i) std::memcpy(qb32 + i * rp + r, qrow + 2 * i, sizeof(uint32_t));
    }
    for (; i < Dp / 2; ++i) qb32[i * rp + r] = 0;
    g.init_row(r);
  }
  g.zero_acc();
  // Head dims past D of K must be zero (they meet q's zero padding; garbage could be NaN),
  // and of V finite. Without padding nothing is zeroed: K rows past a short last chunk
  // only feed scores the causal select replaces, and no V column past the chunk's
  // visible tokens is read (an odd last one is zeroed below). (Zeroing both, 32 KiB a
  // task, showed in a bf16 prefill's profile.)
  if (Dp != D) {
    std::memset(k, 0, static_cast<size_t>(C * Dp) * sizeof(uint16_t));
    std::memset(v, 0, static_cast<size_t>(Dp * C) * sizeof(uint16_t));
  }
  const __m512i interleave = pair_interleave();

  for (int64_t c0 = 0; c0 < g.ctx_end; c0 += C) {
    const int64_t cnt = g.ctx_end - c0 < C ? g.ctx_end - c0 : C;
    // 1. Copy the chunk, block run by block run.
    g.for_each_run(c0, cnt, [&](int64_t at, int64_t off, int64_t t, int64_t run) {
      const uint16_t* kb = kc + at;
      const uint16_t* vb = vc + at;
      for (int64_t i = 0; i < run; ++i) {
        uint16_t* kr = k + (t + i) * Dp;
        for (int64_t c = 0; c < D / X; ++c) {
          std::memcpy(kr + c * X, kb + (c * bs + off + i) * X, X * sizeof(uint16_t));
        }
      }
      // A value row's run: one masked 16-token load and store (a memcpy call per row and
      // run costs a call for a few bytes).
      for (int64_t i = 0; i < run; i += 16) {
        const __mmask16 m = first_lanes16(run - i);  // attention_bf16dp.h
        for (int64_t d = 0; d < D; ++d) {
          _mm256_mask_storeu_epi16(v + d * C + t + i, m,
                                   _mm256_maskz_loadu_epi16(m, vb + d * bs + off + i));
        }
      }
    });
    const int64_t ntok = (cnt + kBlock4 - 1) / kBlock4 * kBlock4;

    // 2. Scores P^T [token, row], scaled.
    for (int64_t t = 0; t < ntok; t += kBlock4) {
      int64_t r = 0;
      for (; r + 4 * 16 <= rp; r += 4 * 16) scores_block_bf16<4>(k, qb, Dp, rp, p.scale, pt, t, r);
      for (; r < rp; r += 16) scores_block_bf16<1>(k, qb, Dp, rp, p.scale, pt, t, r);
    }

    // 3. The online softmax of varlen_task.
    const int64_t pv_end = g.visible(c0, cnt);
    g.online_softmax(p.alibi_slopes, c0, pv_end);

    // 4. The probabilities as bf16 token pairs, in place: pair row tp overwrites P^T row
    // tp's bytes after rows 2 tp and 2 tp + 1 (>= tp) are read. An odd last token pairs
    // with a zero probability (and a zero value: V's column past the chunk's end may hold
    // an earlier chunk's).
    const int64_t npairs = (pv_end + 1) / 2;
    for (int64_t tp = 0; tp < npairs; ++tp) {
      const bool odd = 2 * tp + 1 >= pv_end;
      for (int64_t r = 0; r < rp; r += 16) {
        const __m512 lo = _mm512_loadu_ps(pt + 2 * tp * rp + r);
        const __m512 hi = odd ? _mm512_setzero_ps() : _mm512_loadu_ps(pt + (2 * tp + 1) * rp + r);
        _mm512_storeu_si512(pb + (tp * rp + r) * 2, (__m512i)bf16_pairs(lo, hi, interleave));
      }
    }
    if (pv_end % 2 == 1) {
      for (int64_t d = 0; d < Dp; ++d) v[d * C + pv_end] = 0;
    }

    // 5. acc^T = acc^T * alpha + V P^T.
    for (int64_t d = 0; d < Dp; d += kBlock4) {
      int64_t r = 0;
      for (; r + 4 * 16 <= rp; r += 4 * 16) {
        values_block_bf16<4>(v, pb, g.alpha, rp, npairs, g.acct, d, r);
      }
      for (; r < rp; r += 16) values_block_bf16<1>(v, pb, g.alpha, rp, npairs, g.acct, d, r);
    }
  }

  g.write_out(p);
}

}  // namespace
}  // namespace vllm_lite::cpu
