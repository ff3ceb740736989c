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

  const int64_t tile = task / p.num_kv_heads, kh = task % p.num_kv_heads;
  const int64_t s = p.tile_seq[tile];
  const int64_t q_first = p.query_start_loc[s];
  const int64_t n = p.query_start_loc[s + 1] - q_first;
  const int64_t j0 = p.tile_start[tile];
  const int64_t nq = n - j0 < p.query_tile ? n - j0 : p.query_tile;
  const int64_t L = p.seq_lens[s];
  const int64_t G = p.num_heads / p.num_kv_heads, h0 = kh * G;
  const int64_t D = p.head_size, Dp = padded_head_size(D), bs = p.block_size;
  const int64_t rows = nq * G;
  const int64_t rp = (rows + 15) / 16 * 16;
  const int64_t pos0 = L - n + j0;
  const int64_t ctx_end = pos0 + nq;
  const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
  const int64_t block_stride = p.num_kv_heads * D * bs;
  const uint16_t* kc = static_cast<const uint16_t*>(p.key_cache) + kh * D * bs;
  const uint16_t* vc = static_cast<const uint16_t*>(p.value_cache) + kh * D * bs;

  // varlen_task's scratch sections (varlen_scratch_floats), each used at half its size or
  // less: qb [Dp / 2, rmax, 2] bf16 in q^T's, K [C, Dp] and V [Dp, C] bf16 in theirs, P^T
  // float32 and then its bf16 pairs in P^T's.
  const int64_t rmax = varlen_rows_padded(p);
  float* qt = scratch;
  float* kf = qt + Dp * rmax;
  float* vf = kf + C * Dp;
  float* pt = vf + Dp * C;
  float* acct = pt + C * rmax;
  float* m = acct + Dp * rmax;
  float* l = m + rmax;
  float* alpha = l + rmax;
  float* qpos = alpha + rmax;
  uint16_t* qb = reinterpret_cast<uint16_t*>(qt);
  uint16_t* k = reinterpret_cast<uint16_t*>(kf);
  uint16_t* v = reinterpret_cast<uint16_t*>(vf);
  uint16_t* pb = reinterpret_cast<uint16_t*>(pt);

  for (int64_t r = 0; r < rp; ++r) {
    const uint16_t* qrow = nullptr;
    if (r < rows) {
      const int64_t tok = q_first + j0 + r / G, h = h0 + r % G;
      qrow = static_cast<const uint16_t*>(p.query) + tok * p.q_stride_token + h * p.q_stride_head;
    }
    for (int64_t d = 0; d < Dp; ++d) {
      qb[(d / 2 * rp + r) * 2 + d % 2] = qrow != nullptr && d < D ? qrow[d] : 0;
      acct[d * rp + r] = 0.0f;
    }
    qpos[r] = static_cast<float>(pos0 + (r < rows ? r : rows - 1) / G);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Zero padding: head dims past D of K and V, and tokens past a chunk's end start finite.
  for (int64_t i = 0; i < C * Dp; ++i) k[i] = 0;
  for (int64_t i = 0; i < Dp * C; ++i) v[i] = 0;
  const float* slopes = p.alibi_slopes;
  const __m512i interleave = pair_interleave();

  for (int64_t c0 = 0; c0 < ctx_end; c0 += C) {
    const int64_t cnt = ctx_end - c0 < C ? ctx_end - c0 : C;
    // 1. Copy the chunk, block run by block run.
    for (int64_t t = 0; t < cnt;) {
      const int64_t pos = c0 + t;
      const int64_t block = table[pos / bs], off = pos % bs;
      const int64_t run = bs - off < cnt - t ? bs - off : cnt - t;
      const uint16_t* kb = kc + block * block_stride;
      const uint16_t* vb = vc + block * block_stride;
      for (int64_t i = 0; i < run; ++i) {
        uint16_t* kr = k + (t + i) * Dp;
        for (int64_t c = 0; c < D / X; ++c) {
          std::memcpy(kr + c * X, kb + (c * bs + off + i) * X, X * sizeof(uint16_t));
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        std::memcpy(v + d * C + t, vb + d * bs + off, run * sizeof(uint16_t));
      }
      t += run;
    }
    const int64_t ntok = (cnt + kBlock4 - 1) / kBlock4 * kBlock4;

    // 2. Scores P^T [token, row], scaled.
    for (int64_t t = 0; t < ntok; t += kBlock4) {
      int64_t r = 0;
      for (; r + 4 * 16 <= rp; r += 4 * 16) scores_block_bf16<4>(k, qb, Dp, rp, p.scale, pt, t, r);
      for (; r < rp; r += 16) scores_block_bf16<1>(k, qb, Dp, rp, p.scale, pt, t, r);
    }

    // 3. Online softmax, lane-wise, as varlen_task.
    int64_t pv_end = 0;
    {
      const int64_t last = static_cast<int64_t>(qpos[rp - 1]) + 1 - c0;
      pv_end = last < cnt ? last : cnt;
    }
    for (int64_t r = 0; r < rp; r += VW) {
      const FV pos = load_vec<FV>(qpos + r);
      FV slope = {};
      if (slopes != nullptr) {
        for (int64_t i = 0; i < VW; ++i) slope[i] = r + i < rows ? slopes[h0 + (r + i) % G] : 0.0f;
      }
      FV cm = FV{} - INFINITY;
      for (int64_t t = 0; t < pv_end; ++t) {
        const float tp = static_cast<float>(c0 + t);
        FV x = load_vec<FV>(pt + t * rp + r);
        if (slopes != nullptr) x += slope * (tp - pos);
        x = tp <= pos ? x : FV{} - INFINITY;
        store_vec(pt + t * rp + r, x);
        cm = x > cm ? x : cm;
      }
      const FV mo = load_vec<FV>(m + r);
      const FV mn = cm > mo ? cm : mo;
      const FV a = exp_nonpositive<FV, Vec<int32_t, VW>>(mo - mn);
      FV sum = {};
      for (int64_t t = 0; t < pv_end; ++t) {
        const float tp = static_cast<float>(c0 + t);
        const FV e = exp_nonpositive<FV, Vec<int32_t, VW>>(load_vec<FV>(pt + t * rp + r) - mn);
        const FV pr = tp <= pos ? e : FV{};
        store_vec(pt + t * rp + r, pr);
        sum += pr;
      }
      store_vec(m + r, mn);
      store_vec(alpha + r, a);
      store_vec(l + r, load_vec<FV>(l + r) * a + sum);
    }

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
      for (; r + 4 * 16 <= rp; r += 4 * 16) values_block_bf16<4>(v, pb, alpha, rp, npairs, acct, d, r);
      for (; r < rp; r += 16) values_block_bf16<1>(v, pb, alpha, rp, npairs, acct, d, r);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_first + j0 + r / G, h = h0 + r % G;
    float* o = p.out + (tok * p.num_heads + h) * D;
    const float f = p.v_scale / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = acct[d * rp + r] * f;
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
