// The bfloat16 task of the AVX512-BF16 build (attention_avx512bf16.cpp): the same grid,
// scratch ownership and outputs as attention_task in attention_kernel.h, but the dot
// products run on vdpbf16ps (pairs of bf16 products accumulated in float32), so neither
// K nor V is converted to float32 first.
//   K pass: four consecutive tokens' 8-dim chunk of a block is one contiguous 64-byte row
//     ([block_size, x=8] per chunk), so one load serves 4 tokens; the query chunk is
//     repeated 4 times (qpat). Each lane group of 4 then holds one token's partial sums,
//     summed in-register. The query stays bf16, exact; scale is applied to the sums.
//   V pass: value rows are token-contiguous; the probabilities are rounded to bf16 (as
//     vLLM's CUDA kernel rounds them to the cache type, and FlashAttention and Hugging
//     Face's eager attention before their PV product) and paired with adjacent tokens, 16
//     tokens per 256-bit step, 4 dims x up to 4 heads of accumulators in registers. (Each
//     probability split into two bf16 halves kept float32 accuracy at twice the V pass's
//     products: a 32-sequence x 256-token bf16 9/3x64 call with the caches flushed took
//     0.31-0.39 ms against 0.28-0.29 without the low halves and 0.25-0.26 with no V pass.)
// Tails (a run shorter than 4 or 16 tokens) use masked loads, which never fault on the
// masked-off elements, so no read goes past a block's last token.
#pragma once

#include <immintrin.h>

namespace vllm_lite::cpu {
namespace {

// logits[i .. i+rem) of NG heads for 4 tokens starting at kt (chunk 0 of the key tile).
template <int64_t NG>
VLLM_LITE_INLINE void bf16_key_dots(const uint16_t* kt, int64_t chunk_stride, int64_t chunks,
                                    const uint16_t* qpat, int64_t rem, float scale,
                                    float* lg, int64_t lg_stride) {
  const __mmask32 m = rem >= 4 ? 0xFFFFFFFFu : (1u << (rem * 8)) - 1u;
  __m512 acc[NG];
  for (int64_t g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i kv = _mm512_maskz_loadu_epi16(m, kt + c * chunk_stride);
    for (int64_t g = 0; g < NG; ++g) {
      const __m512i qv = _mm512_load_si512(qpat + (g * chunks + c) * 32);
      acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)qv, (__m512bh)kv);
    }
  }
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  const __mmask8 out_mask = static_cast<__mmask8>((1u << (rem < 4 ? rem : 4)) - 1u);
  for (int64_t g = 0; g < NG; ++g) {
    __m512 t = _mm512_add_ps(acc[g], _mm512_permute_ps(acc[g], 0xB1));  // lanes 0+1, 2+3
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));                    // + the other pair
    const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, t));
    _mm_mask_storeu_ps(lg + g * lg_stride, out_mask, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  }
}

VLLM_LITE_INLINE float hsum256(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// out[g, d] = sum_t p[g, t] * V[t, d] for NG heads, from the probabilities in bf16:
// pb [G, P].
template <int64_t NG>
VLLM_LITE_INLINE void bf16_value_pass(const Runs<uint16_t>& runs, int64_t bs, int64_t D,
                                      const uint16_t* pb, int64_t P, float* const* outs,
                                      float v_scale) {
  constexpr int64_t KD = 4;  // dims per step; D is a multiple of 8
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
        const __mmask16 m = len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1u);
        __m256i v[KD];
        for (int64_t k = 0; k < KD; ++k) v[k] = _mm256_maskz_loadu_epi16(m, row + k * bs + i);
        for (int64_t g = 0; g < NG; ++g) {
          const __m256i pv = _mm256_maskz_loadu_epi16(m, pr + g * P + i);
          for (int64_t k = 0; k < KD; ++k) {
            acc[g][k] = _mm256_dpbf16_ps(acc[g][k], (__m256bh)pv, (__m256bh)v[k]);
          }
        }
      }
    }
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t k = 0; k < KD; ++k) outs[g][d + k] = hsum256(acc[g][k]) * v_scale;
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
  walk_blocks(k, runs, [&](const uint16_t* kblk, int64_t off, int64_t cnt, int64_t first) {
    const int64_t chunk_stride = k.bs * 8;
    for (int64_t i = 0; i < cnt; i += 4) {
      const uint16_t* kt = kblk + (off + i) * 8;
      const int64_t rem = cnt - i;
      float* lg = logits + first + i;
      int64_t g = 0;
      for (; g + 4 <= G; g += 4) {
        bf16_key_dots<4>(kt, chunk_stride, C, qpat + g * C * 32, rem, p.scale, lg + g * P, P);
      }
      switch (G - g) {
        case 3: bf16_key_dots<3>(kt, chunk_stride, C, qpat + g * C * 32, rem, p.scale, lg + g * P, P); break;
        case 2: bf16_key_dots<2>(kt, chunk_stride, C, qpat + g * C * 32, rem, p.scale, lg + g * P, P); break;
        case 1: bf16_key_dots<1>(kt, chunk_stride, C, qpat + g * C * 32, rem, p.scale, lg + g * P, P); break;
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
      const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1u);
      _mm256_mask_storeu_epi16(pb + g * P + i, m,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, lg + i)));
    }
  }

  int64_t g = 0;
  for (; g + 4 <= G; g += 4) bf16_value_pass<4>(runs, k.bs, D, pb + g * P, P, outs + g, p.v_scale);
  switch (G - g) {
    case 3: bf16_value_pass<3>(runs, k.bs, D, pb + g * P, P, outs + g, p.v_scale); break;
    case 2: bf16_value_pass<2>(runs, k.bs, D, pb + g * P, P, outs + g, p.v_scale); break;
    case 1: bf16_value_pass<1>(runs, k.bs, D, pb + g * P, P, outs + g, p.v_scale); break;
    default: break;
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
