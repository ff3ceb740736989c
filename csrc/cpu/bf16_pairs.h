// Interleaving two float32 vectors into bf16 pairs, the operand layout of vdpbf16ps: lane
// pair c holds (v0[c], v1[c]). Used by the packed_linear kernels (a weight row [16 columns,
// k pair]) and the varlen prefill task (probabilities [16 rows, token pair]). Included
// after an AVX512-BF16 target pragma (packed_linear_avx512bf16.cpp,
// attention_avx512bf16.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace vllm_lite::cpu {
namespace {

// lane 2c <- lane c of a vcvtne2ps2bf16 result (its low source), 2c + 1 <- lane 16 + c (its
// high source)
inline __m512i pair_interleave() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// v0 and v1 rounded to bf16 (nearest even) and interleaved: lane pair c = (v0[c], v1[c]).
// interleave: pair_interleave(), hoisted out of the caller's loop.
inline __m512bh bf16_pairs(__m512 v0, __m512 v1, __m512i interleave) {
  return (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
}

// The bf16 pair at p (p[0], p[1]; any alignment) in every lane pair: vdpbf16ps's
// broadcast operand.
inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

}  // namespace
}  // namespace vllm_lite::cpu
