// The bfloat16 task of the AVX512-BF16 build (attention_avx512bf16.cpp): the same grid,
// scratch ownership and outputs as attention_task in attention_kernel.h, but the dot
// products run on vdpbf16ps (pairs of bf16 products accumulated in float32), so neither
// K nor V is converted to float32 first.
//   K pass: four consecutive tokens' 8-dim chunk of a block is one contiguous 64-byte row
//     ([block_size, x=8] per chunk), so one load serves 4 tokens; the query chunk is
//     repeated 4 times (qpat). 16 tokens at a time: four accumulators per head whose lane
//     groups hold one token's partial sums each, folded together into 16 logits. The
//     query stays bf16, exact; scale is applied to the sums.
//   V pass: value rows are token-contiguous; the probabilities are rounded to bf16 (as
//     vLLM's CUDA kernel rounds them to the cache type, and FlashAttention and Hugging
//     Face's eager attention before their PV product) and paired with adjacent tokens, 16
//     tokens per 256-bit step, 8 dims x 3 heads (or 4 x 4) of accumulators in registers.
//     (Each probability split into two bf16 halves would keep float32 accuracy at twice
//     the V pass's products; the rounding matches what those implementations do.)
// Tails (a run shorter than 16 tokens) use masked loads, which never fault on the
// masked-off elements, so no read goes past a block's last token.
#pragma once

#include <immintrin.h>

namespace vllm_lite::cpu {
namespace {

// The first n of 16 lanes (all 16 for n >= 16): the masked loads and stores of a
// run's tail.
VLLM_LITE_INLINE __mmask16 first_lanes16(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
}

// Token order of bf16_key_dots' folded sums: lane 4j + u holds token 4u + j.
VLLM_LITE_INLINE __m512i key_dot_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// logits[i .. i+min(rem, 16)) of NG heads for the 16 tokens from kt (chunk 0 of the key
// tile): four 4-token loads per chunk (u), each one accumulator per head whose lane group
// j holds token 4u + j's partial sums; the four fold into one vector of 16 logits by two
// rounds of in-lane pair sums and one permute. (Folding each 4-token accumulator on its
// own, as this did before, cost more instructions than its dot products at head size 64.)
template <int64_t NG>
VLLM_LITE_INLINE void bf16_key_dots(const uint16_t* kt, int64_t chunk_stride, int64_t chunks,
                                    const uint16_t* qpat, int64_t rem, __m512 scale,
                                    __m512i order, float* lg, int64_t lg_stride) {
  __mmask32 m[4];
  for (int64_t u = 0; u < 4; ++u) {
    const int64_t r = rem - 4 * u;
    m[u] = r >= 4 ? 0xFFFFFFFFu : (r <= 0 ? 0u : (1u << (r * 8)) - 1u);
  }
  __m512 acc[4][NG];
  for (int64_t u = 0; u < 4; ++u) {
    for (int64_t g = 0; g < NG; ++g) acc[u][g] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i qv[NG];
    for (int64_t g = 0; g < NG; ++g) qv[g] = _mm512_load_si512(qpat + (g * chunks + c) * 32);
    for (int64_t u = 0; u < 4; ++u) {
      const __m512i kv = _mm512_maskz_loadu_epi16(m[u], kt + c * chunk_stride + u * 32);
      for (int64_t g = 0; g < NG; ++g) {
        acc[u][g] = _mm512_dpbf16_ps(acc[u][g], (__m512bh)qv[g], (__m512bh)kv);
      }
    }
  }
  const __mmask16 out_mask = first_lanes16(rem);
  for (int64_t g = 0; g < NG; ++g) {
    // Per 128-bit lane j: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of accumulators a, b.
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_ps(acc[0][g], acc[1][g], 0x88),
                                     _mm512_shuffle_ps(acc[0][g], acc[1][g], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_ps(acc[2][g], acc[3][g], 0x88),
                                     _mm512_shuffle_ps(acc[2][g], acc[3][g], 0xDD));
    // Lane 4j + u: the whole dot product of token 4u + j.
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x88),
                                   _mm512_shuffle_ps(s01, s23, 0xDD));
    _mm512_mask_storeu_ps(lg + g * lg_stride, out_mask,
                          _mm512_mul_ps(_mm512_permutexvar_ps(order, t), scale));
  }
}

// The 4 sums of a's and b's, c's, d's lanes: [sum a, sum b, sum c, sum d] in each 128-bit
// half (the low half from lanes 0-3, the high from 4-7).
VLLM_LITE_INLINE __m256 quad_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
}

// out[g, d] = sum_t p[g, t] * V[t, d] for NG heads, from the probabilities in bf16:
// pb [G, P]. KD dims per walk over the runs (NG x KD accumulators, the NG probability
// vectors and a value vector fit the 32 registers for KD = 8 up to NG = 3); each (head,
// KD dims) folds its accumulators at once instead of one horizontal sum per dim.
template <int64_t NG, int64_t KD>
VLLM_LITE_INLINE void bf16_value_pass(const Runs<uint16_t>& runs, int64_t bs, int64_t D,
                                      const uint16_t* pb, int64_t P, float* const* outs,
                                      float v_scale) {
  static_assert(KD == 4 || KD == 8, "D is a multiple of 8");
  for (int64_t d = 0; d < D; d += KD) {
    __m256 acc[NG][KD];
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t k = 0; k < KD; ++k) acc[g][k] = _mm256_setzero_ps();
    }
    for (int64_t r = 0; r < runs.count; ++r) {
      const uint16_t* row = runs.tile[r] + d * bs;
      const uint16_t* pr = pb + runs.first[r];
      const int64_t len = runs.len[r];
      for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 m = first_lanes16(len - i);
        __m256i pv[NG];
        for (int64_t g = 0; g < NG; ++g) pv[g] = _mm256_maskz_loadu_epi16(m, pr + g * P + i);
        for (int64_t k = 0; k < KD; ++k) {
          const __m256i v = _mm256_maskz_loadu_epi16(m, row + k * bs + i);
          for (int64_t g = 0; g < NG; ++g) {
            acc[g][k] = _mm256_dpbf16_ps(acc[g][k], (__m256bh)pv[g], (__m256bh)v);
          }
        }
      }
    }
    for (int64_t g = 0; g < NG; ++g) {
      const __m256 q0 = quad_sums(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      if constexpr (KD == 8) {
        const __m256 q1 = quad_sums(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                                          _mm256_permute2f128_ps(q0, q1, 0x31));
        _mm256_storeu_ps(outs[g] + d, _mm256_mul_ps(sums, _mm256_set1_ps(v_scale)));
      } else {
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(q0), _mm256_extractf128_ps(q0, 1));
        _mm_storeu_ps(outs[g] + d, _mm_mul_ps(sums, _mm_set1_ps(v_scale)));
      }
    }
  }
}

void attention_task_bf16dp(const AttentionParams& p, int64_t task, float* scratch) {
  const Task<uint16_t> k(p, task);
  if (k.empty()) return;
  const int64_t G = k.G, D = k.D, P = p.partition_size, n = k.n();
  const int64_t C = D / 8;  // 8-dim chunks (x = 8 for bf16)

  // Scratch: logits [G, P] floats | qpat [G, C, 32] bf16 | pb [G, P] bf16; 64-byte aligned
  // sections (P and 32 bf16 are multiples of 64 bytes).
  float* logits = scratch;
  uint16_t* qpat = reinterpret_cast<uint16_t*>(logits + G * P);
  uint16_t* pb = qpat + G * C * 32;

  const uint16_t* qs = static_cast<const uint16_t*>(p.query) + k.s * p.q_stride_seq;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = qs + (k.h0 + g) * p.q_stride_head;
    for (int64_t c = 0; c < C; ++c) {
      const __m128i chunk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + c * 8));
      _mm512_store_si512(qpat + (g * C + c) * 32, _mm512_broadcast_i32x4(chunk));
    }
  }

  Runs<uint16_t> runs;
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512i order = key_dot_order();
  walk_blocks(k, runs, [&](const uint16_t* kblk, int64_t off, int64_t cnt, int64_t first) {
    const int64_t chunk_stride = k.bs * 8;
    for (int64_t i = 0; i < cnt; i += 16) {
      const uint16_t* kt = kblk + (off + i) * 8;
      const int64_t rem = cnt - i;
      float* lg = logits + first + i;
      int64_t g = 0;
      for (; g + 4 <= G; g += 4) {
        bf16_key_dots<4>(kt, chunk_stride, C, qpat + g * C * 32, rem, scale, order, lg + g * P, P);
      }
      const uint16_t* qr = qpat + g * C * 32;
      switch (G - g) {
        case 3: bf16_key_dots<3>(kt, chunk_stride, C, qr, rem, scale, order, lg + g * P, P); break;
        case 2: bf16_key_dots<2>(kt, chunk_stride, C, qr, rem, scale, order, lg + g * P, P); break;
        case 1: bf16_key_dots<1>(kt, chunk_stride, C, qr, rem, scale, order, lg + g * P, P); break;
        default: break;
      }
    }
  });

  float* outs[kMaxGroup];  // G <= kMaxQueryHeadsPerKvHead (validate.cpp)
  const float* probs[kMaxGroup];
  softmax(p, k.s, k.part, k.h0, k.start, n, logits, probs, outs);
  for (int64_t g = 0; g < G; ++g) {
    const float* lg = probs[g];
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = first_lanes16(n - i);
      _mm256_mask_storeu_epi16(pb + g * P + i, m,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, lg + i)));
    }
  }

  // V pass: three heads at a time with 8 dims per walk (the register budget), else four
  // with 4 dims.
  const float vs = p.v_scale;
  int64_t g = 0;
  if (G % 3 == 0) {
    for (; g < G; g += 3) bf16_value_pass<3, 8>(runs, k.bs, D, pb + g * P, P, outs + g, vs);
  }
  for (; g + 4 <= G; g += 4) bf16_value_pass<4, 4>(runs, k.bs, D, pb + g * P, P, outs + g, vs);
  switch (G - g) {
    case 3: bf16_value_pass<3, 8>(runs, k.bs, D, pb + g * P, P, outs + g, vs); break;
    case 2: bf16_value_pass<2, 8>(runs, k.bs, D, pb + g * P, P, outs + g, vs); break;
    case 1: bf16_value_pass<1, 8>(runs, k.bs, D, pb + g * P, P, outs + g, vs); break;
    default: break;
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
