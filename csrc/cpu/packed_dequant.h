// Dequantizing one panel of a packed int8 / int4 weight (PackedQuantWeight,
// packed_linear_params.h) for the quantized entry points of the packed kernels: included by
// packed_linear_avx512.cpp (float32 panels) and packed_linear_avx512bf16.cpp (bfloat16
// panels) after their target pragma, so it is built under each file's instruction set
// (AVX-512F/BW/VL); they include <vector> before the pragma (GCC 13 needs it so).
//
// A packed quantized panel holds, per k (int8) or pair of k (int4), one 48-byte row of the
// panel's columns, so 16 contiguous bytes are one vector's 16 columns (a lane a column, the
// float layout's order): each widens to float32 vectors of the 16 columns' weights,
//   int8, per channel: q (exact; the caller's tiles apply the channel's scale to the sums);
//   int8, groups: q * scale[n, k / G], one rounding;
//   int4 (low nibble k = 2j, high 2j + 1): q * scale[n, k / G] + zero[n, k / G], one FMA (the
//         dequantized float32 weight; a bf16 panel then rounds it once more, the
//         dequantized bf16 model's weight, as int8_linear's row kernels do).
// Scales and zeros ([N, K / G], row-major) come by 16-lane gathers, once per group. Columns
// past N (zero bytes in the packed weight, zero scales) and k past q's K (up to the padded
// K the caller asks for) come out zero. Meanwhile the next panel's bytes and scales are
// prefetched, so the tiles that follow are not the only thing between the loads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/packed_linear_params.h"
#include "cpu/packed_tile.h"

namespace vllm_lite::cpu {
namespace {

// The 16 lanes' row offsets (lane c: c * row elements), for the scale / zero gathers.
inline __m512i lane_rows(int64_t row) {
  return _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(row)));
}

// Vector-extension types for the widening converts: GCC 12 warns (-Wmaybe-uninitialized, a
// false positive) on the undefined pass-through operand of _mm512_cvtepi32_ps and its kin
// once they are inlined here; __builtin_convertvector gives the same instructions.
using U8x16 = uint8_t __attribute__((vector_size(16)));
using I32x16 = int32_t __attribute__((vector_size(64)));
using F32x16 = float __attribute__((vector_size(64)));

// Widened to int32 first (vpmovsxbd / vpmovzxbd): GCC 12 scalarizes a direct 8-bit ->
// float convert, and a signed 8 -> 32-bit one, so that one is the (zero-masked, no
// pass-through) intrinsic.
inline __m512 int8_to_f32(__m128i b) {
  return (__m512)__builtin_convertvector((I32x16)_mm512_maskz_cvtepi8_epi32(0xFFFF, b), F32x16);
}
inline __m512 uint8_to_f32(__m128i b) {
  return (__m512)__builtin_convertvector(__builtin_convertvector((U8x16)b, I32x16), F32x16);
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Calls emit(b, k, v0, v1) for k = 0, 2, 4, ... below kp (kp >= qw.K; int4: kp == K) and the
// panel's vectors b = 0 .. kPackedPanelVecs - 1: v0 / v1 = the float32 weights W[n, k] /
// W[n, k + 1] of vector b's 16 columns n = p * kPackedPanelCols + 16 b + c (lane c; zero
// past N or past q's K). prefetch_next: prefetch panel p + 1 meanwhile.
template <typename Emit>
inline void dequant_panel(const PackedQuantWeight& qw, int64_t p, int64_t N, int64_t kp,
                          bool prefetch_next, Emit&& emit) {
  constexpr int64_t NV = kPackedPanelVecs, W = kPackedPanelCols;
  const int64_t K = qw.K, G = qw.group_size, groups = G > 0 ? K / G : 0;
  // G is 32, 64 or 128: a shift and a mask instead of a division per step
  const int gshift = G > 0 ? __builtin_ctzll(static_cast<unsigned long long>(G)) : 0;
  const int64_t rows = qw.int4 ? K / 2 : K, n0 = p * W, cols = std::min(W, N - n0);
  const uint8_t* q = static_cast<const uint8_t*>(qw.q) + p * rows * W;
  const char* next = reinterpret_cast<const char*>(q + rows * W);
  __mmask16 live[NV];
  for (int64_t b = 0; b < NV; ++b) live[b] = vector_cols_mask(cols, b);
  const __m512i group_rows = lane_rows(groups);
  const float* scales = qw.scales != nullptr ? qw.scales + n0 * groups : nullptr;
  const float* zeros = qw.zeros != nullptr ? qw.zeros + n0 * groups : nullptr;
  __m512 s[NV], z[NV];
  for (int64_t b = 0; b < NV; ++b) s[b] = z[b] = _mm512_setzero_ps();
  // Group g's scales (and zeros) of the panel's columns; the next panel's W x groups floats
  // are 3 lines per group.
  auto load_group = [&](int64_t g) {
    for (int64_t b = 0; b < NV; ++b) {
      const int64_t c = b * kPackedVecCols * groups + g;
      s[b] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live[b], group_rows, scales + c, 4);
      if (zeros != nullptr) {
        z[b] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live[b], group_rows, zeros + c, 4);
      }
    }
    if (prefetch_next) {
      const char* next_scales = reinterpret_cast<const char*>(scales + W * groups);
      const char* next_zeros =
          zeros != nullptr ? reinterpret_cast<const char*>(zeros + W * groups) : nullptr;
      for (int64_t l = 0; l < 3; ++l) {
        _mm_prefetch(next_scales + (3 * g + l) * 64, _MM_HINT_T0);
        if (zeros != nullptr) _mm_prefetch(next_zeros + (3 * g + l) * 64, _MM_HINT_T0);
      }
    }
  };
  if (qw.int4) {
    const U8x16 low4 = U8x16{} + 0x0F;
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t k = 2 * j;
      if ((k & (G - 1)) == 0) load_group(k >> gshift);
      if (prefetch_next) _mm_prefetch(next + j * W, _MM_HINT_T0);
      for (int64_t b = 0; b < NV; ++b) {
        const U8x16 v = (U8x16)load16(q + j * W + b * kPackedVecCols);
        emit(b, k, _mm512_fmadd_ps(uint8_to_f32((__m128i)(v & low4)), s[b], z[b]),
             _mm512_fmadd_ps(uint8_to_f32((__m128i)(v >> 4)), s[b], z[b]));
      }
    }
    return;
  }
  for (int64_t k = 0; k < kp; k += 2) {
    if (G > 0 && (k & (G - 1)) == 0) load_group(k >> gshift);
    if (prefetch_next) {  // the two rows' 96 bytes
      _mm_prefetch(next + k * W, _MM_HINT_T0);
      _mm_prefetch(next + k * W + 64, _MM_HINT_T0);
    }
    for (int64_t b = 0; b < NV; ++b) {
      const uint8_t* qk = q + k * W + b * kPackedVecCols;
      __m512 v0 = k < K ? int8_to_f32(load16(qk)) : _mm512_setzero_ps();
      __m512 v1 = k + 1 < K ? int8_to_f32(load16(qk + W)) : _mm512_setzero_ps();
      if (G > 0) {
        v0 = _mm512_mul_ps(v0, s[b]);
        v1 = _mm512_mul_ps(v1, s[b]);
      }
      emit(b, k, v0, v1);
    }
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
