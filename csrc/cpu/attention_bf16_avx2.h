// The bfloat16 task of the AVX2 build (attention_avx2.cpp): the same grid, scratch
// ownership, float32 arithmetic and outputs as attention_task in attention_kernel.h, with
// the bf16 -> float32 conversion done once per loaded element pair instead of once per
// element and query head.
//   Conversion: a 32-bit lane holding bf16 elements (a, b) at (2i, 2i + 1) gives both
//     exactly: a = lane << 16, b = lane & 0xffff0000. One 256-bit load of 16 elements thus
//     becomes two float32 vectors (even and odd elements) in two integer ops; the operand
//     they meet is laid out the same way (even and odd query dims, even and odd tokens'
//     probabilities). The generic task widens 8 elements per load (vpmovzxwd + shift) and,
//     with 16 registers, repeats that for every query head of the KV head.
//   K pass: a block's key tile is [head_size / 8, block_size, 8], so two consecutive
//     tokens' 8-dim chunk is one 32-byte row: lanes 0-3 hold token t's dims, 4-7 token
//     t + 1's. TOK tokens at a time for NG query heads, one accumulator per (token pair,
//     head), folded into TOK logits by horizontal adds.
//   V pass: a value tile is [head_size, block_size], so one load is 16 tokens of one dim;
//     the probabilities are stored even tokens then odd tokens per 16 (deinterleaved) to
//     match. DD dims x NG heads of accumulators, reduced once per (head, dim).
// Needs block_size a multiple of 16 that divides the partition size (so each 16-token group
// of a partition lies in one block): run_task falls back to the generic task otherwise.
// A run's last partial group (the sequence's end) is copied to zero-padded buffers first,
// so nothing past the run is read.
#pragma once

#include <immintrin.h>

namespace vllm_lite::cpu {
namespace {

VLLM_LITE_INLINE __m256 bf16_even(__m256i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
VLLM_LITE_INLINE __m256 bf16_odd(__m256i v, __m256i hi_mask) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
}

// Whether the AVX2 bf16 task handles this call (else the generic one does).
VLLM_LITE_INLINE bool bf16_avx2_fits(const AttentionParams& p) {
  return p.block_size % 16 == 0 && p.partition_size % p.block_size == 0;
}

// Logits of TOK consecutive tokens (TOK / 2 pairs) for NG heads: kt points at chunk 0 of
// the first token, chunks chunk_stride elements apart; qp at head 0's query pattern
// ([C][even 8 | odd 8] floats per head, qs floats apart). lg[g * lg_stride + t].
template <int64_t NG, int64_t TOK>
VLLM_LITE_INLINE void bf16_avx2_key_dots(const uint16_t* kt, int64_t chunk_stride, int64_t C,
                                         const float* qp, int64_t qs, float* lg,
                                         int64_t lg_stride) {
  static_assert(TOK == 4 || TOK == 8, "two or four token pairs");
  constexpr int64_t U = TOK / 2;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[U][NG];
  for (int64_t u = 0; u < U; ++u) {
    for (int64_t g = 0; g < NG; ++g) acc[u][g] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < C; ++c) {
    const uint16_t* row = kt + c * chunk_stride;
    __m256 ev[U], od[U];
    for (int64_t u = 0; u < U; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + u * 16));
      ev[u] = bf16_even(v);
      od[u] = bf16_odd(v, hi);
    }
    for (int64_t g = 0; g < NG; ++g) {
      const __m256 qe = _mm256_load_ps(qp + g * qs + c * 16);
      const __m256 qo = _mm256_load_ps(qp + g * qs + c * 16 + 8);
      for (int64_t u = 0; u < U; ++u) {
        acc[u][g] = _mm256_fmadd_ps(qe, ev[u], acc[u][g]);
        acc[u][g] = _mm256_fmadd_ps(qo, od[u], acc[u][g]);
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g) {
    // acc[u]: lanes 0-3 token 2u's partial sums, 4-7 token 2u + 1's.
    if constexpr (U == 2) {
      const __m256 h = _mm256_hadd_ps(acc[0][g], acc[1][g]);
      const __m256 s = _mm256_hadd_ps(h, h);  // low: t0 t2 t0 t2, high: t1 t3 t1 t3
      _mm_storeu_ps(lg + g * lg_stride,
                    _mm_unpacklo_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    } else {
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][g], acc[1][g]),
                                      _mm256_hadd_ps(acc[2][g], acc[3][g]));
      // low: t0 t2 t4 t6, high: t1 t3 t5 t7
      const __m128 lo = _mm256_castps256_ps128(s), hi4 = _mm256_extractf128_ps(s, 1);
      _mm_storeu_ps(lg + g * lg_stride, _mm_unpacklo_ps(lo, hi4));
      _mm_storeu_ps(lg + g * lg_stride + 4, _mm_unpackhi_ps(lo, hi4));
    }
  }
}

// One block run's logits for NG heads: whole steps of TOK tokens from the tile, then a
// partial step from a zero-padded copy (logits of the copy's padding are not stored).
template <int64_t NG, int64_t TOK>
VLLM_LITE_INLINE void bf16_avx2_key_run(const uint16_t* kblk, int64_t bs, int64_t off,
                                        int64_t cnt, int64_t C, const float* qp, int64_t qs,
                                        float* lg, int64_t lg_stride) {
  const int64_t whole = cnt / TOK * TOK;
  for (int64_t i = 0; i < whole; i += TOK) {
    bf16_avx2_key_dots<NG, TOK>(kblk + (off + i) * 8, bs * 8, C, qp, qs, lg + i, lg_stride);
  }
  const int64_t rem = cnt - whole;
  if (rem == 0) return;
  alignas(32) uint16_t kb[kMaxHeadSize / 8 * TOK * 8] = {};
  for (int64_t c = 0; c < C; ++c) {
    std::memcpy(kb + c * TOK * 8, kblk + (c * bs + off + whole) * 8,
                static_cast<size_t>(rem) * 8 * sizeof(uint16_t));
  }
  float tail[NG * TOK];
  bf16_avx2_key_dots<NG, TOK>(kb, TOK * 8, C, qp, qs, tail, TOK);
  for (int64_t g = 0; g < NG; ++g) {
    for (int64_t t = 0; t < rem; ++t) lg[g * lg_stride + whole + t] = tail[g * TOK + t];
  }
}

// out[g, d] = sum_t p[g, t] * V[t, d] for NG heads, DD dims per walk over the runs; pd
// holds head g's probabilities at pd + g * P, deinterleaved per 16 tokens (8 even, 8 odd).
template <int64_t NG, int64_t DD>
VLLM_LITE_INLINE void bf16_avx2_value_pass(const Runs<uint16_t>& runs, int64_t bs, int64_t D,
                                           const float* pd, int64_t P, float* const* outs,
                                           float v_scale) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t d = 0; d < D; d += DD) {
    __m256 acc[NG][DD];
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t k = 0; k < DD; ++k) acc[g][k] = _mm256_setzero_ps();
    }
    auto step = [&](const uint16_t* rows, int64_t row_stride, const float* pr) {
      for (int64_t k = 0; k < DD; ++k) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + k * row_stride));
        const __m256 ve = bf16_even(v), vo = bf16_odd(v, hi);
        for (int64_t g = 0; g < NG; ++g) {
          acc[g][k] = _mm256_fmadd_ps(_mm256_load_ps(pr + g * P), ve, acc[g][k]);
          acc[g][k] = _mm256_fmadd_ps(_mm256_load_ps(pr + g * P + 8), vo, acc[g][k]);
        }
      }
    };
    for (int64_t r = 0; r < runs.count; ++r) {
      const uint16_t* row = runs.tile[r] + d * bs;
      const float* pr = pd + runs.first[r];
      const int64_t len = runs.len[r];
      const int64_t whole = len / 16 * 16;
      for (int64_t i = 0; i < whole; i += 16) step(row + i, bs, pr + i);
      if (whole < len) {
        alignas(32) uint16_t vb[DD * 16] = {};
        for (int64_t k = 0; k < DD; ++k) {
          std::memcpy(vb + k * 16, row + k * bs + whole,
                      static_cast<size_t>(len - whole) * sizeof(uint16_t));
        }
        step(vb, 16, pr + whole);  // pd is zero past the partition's last token
      }
    }
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t k = 0; k < DD; ++k) outs[g][d + k] = hsum(acc[g][k]) * v_scale;
    }
  }
}

void attention_task_bf16_avx2(const AttentionParams& p, int64_t task, float* scratch) {
  const Task<uint16_t> k(p, task);
  if (k.empty()) return;
  const int64_t G = k.G, D = k.D, P = p.partition_size, n = k.n();
  const int64_t C = D / 8;  // 8-dim key chunks (x = 8 for bf16)

  // Scratch (attention_scratch_floats, 64-byte aligned): logits [G, P] | deinterleaved
  // probabilities [G, P] | query pattern [G, C, 16] (2 x G x D <= 2 x G x padded head).
  float* logits = scratch;
  float* pd = logits + G * P;
  float* qp = pd + G * P;
  const int64_t qs = C * 16;

  // The query times scale in float32, even dims then odd dims of each 8-dim chunk, each
  // half repeated for the two tokens of a key row.
  const uint16_t* qrow = static_cast<const uint16_t*>(p.query) + k.s * p.q_stride_seq;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = qrow + (k.h0 + g) * p.q_stride_head;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < 4; ++j) {
        const float e = bits_to_float(static_cast<uint32_t>(qg[c * 8 + 2 * j]) << 16) * p.scale;
        const float o =
            bits_to_float(static_cast<uint32_t>(qg[c * 8 + 2 * j + 1]) << 16) * p.scale;
        qp[g * qs + c * 16 + j] = qp[g * qs + c * 16 + 4 + j] = e;
        qp[g * qs + c * 16 + 8 + j] = qp[g * qs + c * 16 + 12 + j] = o;
      }
    }
  }

  // 1. K pass: four heads at a time over 4-token steps (8 accumulators), fewer heads over
  // 8-token steps (so that there are still 4-8 independent accumulators).
  Runs<uint16_t> runs;
  walk_blocks(k, runs, [&](const uint16_t* kblk, int64_t off, int64_t cnt, int64_t first) {
    float* lg = logits + first;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
      bf16_avx2_key_run<4, 4>(kblk, k.bs, off, cnt, C, qp + g * qs, qs, lg + g * P, P);
    }
    const float* q = qp + g * qs;
    switch (G - g) {
      case 3: bf16_avx2_key_run<3, 4>(kblk, k.bs, off, cnt, C, q, qs, lg + g * P, P); break;
      case 2: bf16_avx2_key_run<2, 8>(kblk, k.bs, off, cnt, C, q, qs, lg + g * P, P); break;
      case 1: bf16_avx2_key_run<1, 8>(kblk, k.bs, off, cnt, C, q, qs, lg + g * P, P); break;
      default: break;
    }
  });

  // 2. Softmax (float32, in place), then each head's probabilities deinterleaved per 16
  // tokens for the V pass, zero past the last token.
  float* outs[kMaxGroup];  // G <= kMaxQueryHeadsPerKvHead (validate.cpp)
  const float* probs[kMaxGroup];
  softmax(p, k.s, k.part, k.h0, k.start, n, logits, probs, outs);
  const int64_t n16 = (n + 15) / 16 * 16;
  for (int64_t g = 0; g < G; ++g) {
    const float* src = probs[g];
    float* dst = pd + g * P;
    for (int64_t i = 0; i < n16; i += 16) {
      for (int64_t j = 0; j < 8; ++j) {
        dst[i + j] = i + 2 * j < n ? src[i + 2 * j] : 0.0f;
        dst[i + 8 + j] = i + 2 * j + 1 < n ? src[i + 2 * j + 1] : 0.0f;
      }
    }
  }

  // 3. V pass: four heads x 2 dims of accumulators, or fewer heads x 4 dims.
  const float vs = p.v_scale;
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) bf16_avx2_value_pass<4, 2>(runs, k.bs, D, pd + g * P, P, outs + g, vs);
  switch (G - g) {
    case 3: bf16_avx2_value_pass<3, 2>(runs, k.bs, D, pd + g * P, P, outs + g, vs); break;
    case 2: bf16_avx2_value_pass<2, 4>(runs, k.bs, D, pd + g * P, P, outs + g, vs); break;
    case 1: bf16_avx2_value_pass<1, 4>(runs, k.bs, D, pd + g * P, P, outs + g, vs); break;
    default: break;
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
