// The AVX2 + FMA build of fused_moe's few-rows GEMM (moe_rows_gemm.h), chosen at run time
// on builds without a packed kernel for the dtype. Per block of x's rows, a tile is NR
// rows of W against MR rows of x: per 8 k, one load of each x row, one load (bfloat16: widened to float32) of each W
// row, NR x MR FMAs; the sums reduce across lanes once at the end. A group of NR rows of W
// (16 KiB for K 1024 in float32) stays in L1 while the pairs of x rows pass, so W is read
// from memory once. Standard headers come first, under the default target.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/moe_rows_gemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

namespace vllm_lite::cpu {
namespace {

struct F32 {
  using T = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static float scalar(const float* p) { return *p; }
  static void store(float* y, float v) { *y = v; }
};

struct Bf16 {
  using T = uint16_t;
  static __m256 load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static float scalar(const uint16_t* p) {
    const uint32_t b = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  }
  // Nearest even; a NaN stays a (quiet) NaN of its sign, as torch's cast.
  static void store(uint16_t* y, float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof(b));
    *y = (b & 0x7fffffffu) > 0x7f800000u
             ? static_cast<uint16_t>((b >> 16) | 0x40u)
             : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] for m < MR, n < NR: x rows [MR, K], w rows [NR, K] (row stride K both).
template <typename W, int NR, int MR>
inline void tile(const float* x, int64_t K, const typename W::T* w, typename W::T* y,
                 int64_t ldy) {
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n) {
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_setzero_ps();
  }
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      const __m256 wv = W::load(w + n * K + k);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  }
  for (int n = 0; n < NR; ++n) {
    for (int m = 0; m < MR; ++m) {
      float s = hsum(acc[n][m]);
      for (int64_t k = K8; k < K; ++k) s += W::scalar(w + n * K + k) * x[m * K + k];
      W::store(y + m * ldy + n, s);
    }
  }
}

template <typename W, int NR>
inline void rows_of(const float* x, int64_t M, int64_t K, const typename W::T* w,
                    typename W::T* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<W, NR, 2>(x + m * K, K, w, y + m * ldy, ldy);
  if (m < M) tile<W, NR, 1>(x + m * K, K, w, y + m * ldy, ldy);
}

template <typename W>
void rows_gemm(const float* x, int64_t M, int64_t K, const void* w_, void* y_, int64_t ldy,
               int64_t n0, int64_t n1) {
  constexpr int NR = 4;
  const auto* w = static_cast<const typename W::T*>(w_);
  auto* y = static_cast<typename W::T*>(y_);
  for (int64_t m0 = 0; m0 < M; m0 += kMoeRowsGemmBlockRows) {
    const int64_t rows = std::min(kMoeRowsGemmBlockRows, M - m0);
    const float* xb = x + m0 * K;
    auto* yb = y + m0 * ldy;
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) rows_of<W, NR>(xb, rows, K, w + n * K, yb + (n - n0), ldy);
    for (; n < n1; ++n) rows_of<W, 1>(xb, rows, K, w + n * K, yb + (n - n0), ldy);
  }
}

}  // namespace

MoeRowsGemmFn moe_rows_gemm_f32_avx2() { return &rows_gemm<F32>; }
MoeRowsGemmFn moe_rows_gemm_bf16_avx2() { return &rows_gemm<Bf16>; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::MoeRowsGemmFn vllm_lite::cpu::moe_rows_gemm_f32_avx2() { return nullptr; }
vllm_lite::cpu::MoeRowsGemmFn vllm_lite::cpu::moe_rows_gemm_bf16_avx2() { return nullptr; }
#endif
