// The AVX512-BF16 build of int8_linear / int4_linear for bfloat16 activations: y =
// bf16(scales[n] * sum_k x[m, k] * q[n, k] + bias[n]), the products on vdpbf16ps (pairs of
// bf16 products accumulated in float32). An int8 weight is exact in bfloat16 (at most 8
// significant bits) and so is each product, so the only roundings are the float32
// accumulation and the final bfloat16 store: more exact than dequantizing the weight to
// bfloat16 first. Group-wise weights (int8 with [N, K / G] scales, int4) cannot keep the
// scale outside the sum, so they are widened to bf16(dequantized weight), the bfloat16
// model's own weight.
//
// Layouts: x [M, K] bf16 (row stride x_row_stride), q [N, K] int8 contiguous, scales [N] and
// bias [N] (or null) float32, y [M, N] bf16 contiguous. One call covers the output channels
// [n0, n1) of every row of x. Passes of kInt8RowsPerPass (4) weight rows are widened to
// bf16 once into `wbuf` (4 x round_up(K, 32) bf16, zero-padded, the caller's) and dotted
// with 4 activation rows at a time (a register tile of 16 float32 accumulators; one row, a
// batch-1 decode, has a loop of its own), 4 + 4 loads per 16 vdpbf16ps.
// Each accumulator's 16 lanes are summed at the end (4 at a time, shuffles), so K should be
// a few hundred for that to be small. No row limit: the widening is paid once per call
// whatever M is. Chosen at run time on CPUs with AVX-512F/BW/VL/DQ and AVX512_BF16 (the
// "avx512bf16" CPU build); other builds convert x to float32 and run the float32 kernel.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/int8_linear_params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "cpu/gcc12_avx512.h"  // before the intrinsics: GCC 12's false warnings
#include <immintrin.h>  // its intrinsics carry their own target attributes
#if defined(__clang__)
#pragma clang attribute push(                                                           \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,prefer-vector-width=512")
#endif

namespace vllm_lite::cpu {
namespace {

constexpr int64_t kStep = 32;  // bf16 per vector (16 pairs)

// wbuf row j (kp bf16) = weight row j widened, zeros past K; with groups (G > 0, K a
// multiple of G >= 32), each weight times its group's scale, rounded to bf16 (the weight of
// the dequantized bfloat16 model).
inline void widen_rows(const int8_t* q, const float* scales, int64_t K, int64_t G, int64_t kp,
                       int64_t nb, uint16_t* wbuf) {
  for (int64_t j = 0; j < kInt8RowsPerPass; ++j) {
    uint16_t* w = wbuf + j * kp;
    if (j >= nb) {  // a short pass: zero rows, so the 4-row dots stay correct (unused)
      std::memset(w, 0, static_cast<size_t>(kp) * sizeof(uint16_t));
      continue;
    }
    const int8_t* qr = q + j * K;
    for (int64_t k = 0; k < kp; k += kStep) {
      const int64_t rem = K - k;
      const __mmask32 m = rem >= kStep ? ~__mmask32{0} : (__mmask32{1} << rem) - 1;
      const __m256i b = _mm256_maskz_loadu_epi8(m, qr + k);  // never reads past the row
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      if (G > 0) {
        const __m512 sc = _mm512_set1_ps(scales[j * (K / G) + k / G]);
        lo = _mm512_mul_ps(lo, sc);
        hi = _mm512_mul_ps(hi, sc);
      }
      _mm512_storeu_si512(w + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // lo -> low half
    }
  }
}

// int4: wbuf row j = bf16(q * scale + zero) of weight row j, the weight that dequantizing
// to float32 and casting to bfloat16 gives (so a kept int4 layer matches the dequantized
// bfloat16 model's weight). K is a multiple of G >= 32, so a 32-weight step never crosses
// a group.
inline void widen_int4_rows(const uint8_t* q, const float* scales, const float* zeros,
                            int64_t K, int64_t G, int64_t nb, uint16_t* wbuf) {
  const int64_t groups = K / G;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t j = 0; j < kInt8RowsPerPass; ++j) {
    uint16_t* w = wbuf + j * K;
    if (j >= nb) {
      std::memset(w, 0, static_cast<size_t>(K) * sizeof(uint16_t));
      continue;
    }
    const uint8_t* qr = q + j * (K / 2);
    for (int64_t k = 0; k < K; k += kStep) {
      const int64_t g = j * groups + k / G;
      const __m512 sc = _mm512_set1_ps(scales[g]);
      const __m512 zr = _mm512_set1_ps(zeros[g]);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k / 2));
      const __m128i lo = _mm_and_si128(b, low4);                     // k = 2i
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);  // k = 2i + 1
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
      _mm512_storeu_si512(w + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f1, sc, zr),
                                                               _mm512_fmadd_ps(f0, sc, zr)));
    }
  }
}

// The sums of the 16 lanes of a, b, c, d, in lanes 0..3.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: ab = [a0 b0 a1 b1], cd = [c0 d0 c1 d1] (partial sums)
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // per 128-bit lane: [a b c d]; add the four lanes
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Rows m .. m + rows (1..4) of x against the 4 widened weight rows; writes y[m + r, n .. n + nb).
// Always 4 rows of arithmetic (a short tile repeats its last row, not stored): the 16
// accumulators are named variables, because GCC keeps an array of vectors in memory and
// stores it every iteration.
inline void dot_tile(const uint16_t* x, int64_t xs, int64_t rows, int64_t K,
                     const uint16_t* wbuf, int64_t kp, __m128 scale, __m128 bias, int64_t nb,
                     uint16_t* y, int64_t N) {
  const uint16_t* x0 = x;
  const uint16_t* x1 = x + std::min<int64_t>(1, rows - 1) * xs;
  const uint16_t* x2 = x + std::min<int64_t>(2, rows - 1) * xs;
  const uint16_t* x3 = x + std::min<int64_t>(3, rows - 1) * xs;
  const uint16_t* w0 = wbuf;
  const uint16_t* w1 = wbuf + kp;
  const uint16_t* w2 = wbuf + 2 * kp;
  const uint16_t* w3 = wbuf + 3 * kp;
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m512 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  __m512 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  for (int64_t k = 0; k < kp; k += kStep) {
    const int64_t rem = K - k;
    // masked: x's row may end at K (the next row, or nothing, follows)
    const __mmask32 m = rem >= kStep ? ~__mmask32{0} : (__mmask32{1} << rem) - 1;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + k);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + k);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w2 + k);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(w3 + k);
    __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, x0 + k);
    a00 = _mm512_dpbf16_ps(a00, v, b0);
    a01 = _mm512_dpbf16_ps(a01, v, b1);
    a02 = _mm512_dpbf16_ps(a02, v, b2);
    a03 = _mm512_dpbf16_ps(a03, v, b3);
    v = (__m512bh)_mm512_maskz_loadu_epi16(m, x1 + k);
    a10 = _mm512_dpbf16_ps(a10, v, b0);
    a11 = _mm512_dpbf16_ps(a11, v, b1);
    a12 = _mm512_dpbf16_ps(a12, v, b2);
    a13 = _mm512_dpbf16_ps(a13, v, b3);
    v = (__m512bh)_mm512_maskz_loadu_epi16(m, x2 + k);
    a20 = _mm512_dpbf16_ps(a20, v, b0);
    a21 = _mm512_dpbf16_ps(a21, v, b1);
    a22 = _mm512_dpbf16_ps(a22, v, b2);
    a23 = _mm512_dpbf16_ps(a23, v, b3);
    v = (__m512bh)_mm512_maskz_loadu_epi16(m, x3 + k);
    a30 = _mm512_dpbf16_ps(a30, v, b0);
    a31 = _mm512_dpbf16_ps(a31, v, b1);
    a32 = _mm512_dpbf16_ps(a32, v, b2);
    a33 = _mm512_dpbf16_ps(a33, v, b3);
  }
  const __m128 sums[4] = {sum4(a00, a01, a02, a03), sum4(a10, a11, a12, a13),
                          sum4(a20, a21, a22, a23), sum4(a30, a31, a32, a33)};
  const __mmask8 out = static_cast<__mmask8>((1u << nb) - 1u);
  for (int64_t r = 0; r < rows; ++r) {
    // round to nearest even (vcvtneps2bf16), 4 bf16 in the low 64 bits
    const __m128i h = (__m128i)_mm_cvtneps_pbh(_mm_fmadd_ps(sums[r], scale, bias));
    _mm_mask_storeu_epi16(y + r * N, out, h);
  }
}

// One activation row (a batch-1 decode) against the 4 widened weight rows: the 4-row tile
// would repeat the row 4 times, so this loop has 4 accumulators per half of a 64-wide step
// (8 in all, enough independent chains for vdpbf16ps's latency).
inline void dot_row(const uint16_t* x, int64_t K, const uint16_t* wbuf, int64_t kp,
                    __m128 scale, __m128 bias, int64_t nb, uint16_t* y) {
  const uint16_t* w0 = wbuf;
  const uint16_t* w1 = wbuf + kp;
  const uint16_t* w2 = wbuf + 2 * kp;
  const uint16_t* w3 = wbuf + 3 * kp;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t k = 0;
  for (; k + 2 * kStep <= kp; k += 2 * kStep) {
    const int64_t rem = K - k - kStep;  // the second half may hold x's tail
    const __mmask32 m = rem >= kStep ? ~__mmask32{0} : (__mmask32{1} << rem) - 1;
    const __m512bh u = (__m512bh)_mm512_loadu_si512(x + k);
    const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k + kStep);
    a0 = _mm512_dpbf16_ps(a0, u, (__m512bh)_mm512_loadu_si512(w0 + k));
    a1 = _mm512_dpbf16_ps(a1, u, (__m512bh)_mm512_loadu_si512(w1 + k));
    a2 = _mm512_dpbf16_ps(a2, u, (__m512bh)_mm512_loadu_si512(w2 + k));
    a3 = _mm512_dpbf16_ps(a3, u, (__m512bh)_mm512_loadu_si512(w3 + k));
    b0 = _mm512_dpbf16_ps(b0, v, (__m512bh)_mm512_loadu_si512(w0 + k + kStep));
    b1 = _mm512_dpbf16_ps(b1, v, (__m512bh)_mm512_loadu_si512(w1 + k + kStep));
    b2 = _mm512_dpbf16_ps(b2, v, (__m512bh)_mm512_loadu_si512(w2 + k + kStep));
    b3 = _mm512_dpbf16_ps(b3, v, (__m512bh)_mm512_loadu_si512(w3 + k + kStep));
  }
  if (k < kp) {  // one 32-wide step left
    const int64_t rem = K - k;
    const __mmask32 m = rem >= kStep ? ~__mmask32{0} : (__mmask32{1} << rem) - 1;
    const __m512bh u = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
    a0 = _mm512_dpbf16_ps(a0, u, (__m512bh)_mm512_loadu_si512(w0 + k));
    a1 = _mm512_dpbf16_ps(a1, u, (__m512bh)_mm512_loadu_si512(w1 + k));
    a2 = _mm512_dpbf16_ps(a2, u, (__m512bh)_mm512_loadu_si512(w2 + k));
    a3 = _mm512_dpbf16_ps(a3, u, (__m512bh)_mm512_loadu_si512(w3 + k));
  }
  const __m128 sums = sum4(_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1),
                           _mm512_add_ps(a2, b2), _mm512_add_ps(a3, b3));
  const __m128i h = (__m128i)_mm_cvtneps_pbh(_mm_fmadd_ps(sums, scale, bias));
  _mm_mask_storeu_epi16(y, static_cast<__mmask8>((1u << nb) - 1u), h);
}

// Rows m .. m + M of x: the one-row loop for a single row, else 4-row tiles.
inline void dot_rows(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wbuf,
                     int64_t kp, __m128 scale, __m128 bias, int64_t nb, uint16_t* y,
                     int64_t N) {
  if (M == 1) {
    dot_row(x, K, wbuf, kp, scale, bias, nb, y);
    return;
  }
  for (int64_t m = 0; m < M; m += 4) {
    dot_tile(x + m * xs, xs, std::min<int64_t>(4, M - m), K, wbuf, kp, scale, bias, nb,
             y + m * N, N);
  }
}

void int8_linear_bf16_block(const Int8LinearBf16Args& a, int64_t n0, int64_t n1,
                            uint16_t* wbuf) {
  const int64_t K = a.K, kp = int8_bf16_padded_k(K);
  for (int64_t n = n0; n < n1; n += kInt8RowsPerPass) {
    const int64_t nb = std::min<int64_t>(kInt8RowsPerPass, n1 - n);
    const int64_t G = a.group_size;
    widen_rows(a.q + n * K, G > 0 ? a.scales + n * (K / G) : nullptr, K, G, kp, nb, wbuf);
    const __mmask8 lanes = static_cast<__mmask8>((1u << nb) - 1u);
    const __m128 scale = G > 0 ? _mm_set1_ps(1.0f) : _mm_maskz_loadu_ps(lanes, a.scales + n);
    const __m128 bias = a.bias != nullptr ? _mm_maskz_loadu_ps(lanes, a.bias + n)
                                          : _mm_setzero_ps();
    dot_rows(a.x, a.x_row_stride, a.M, K, wbuf, kp, scale, bias, nb, a.y + n, a.N);
  }
}

void int4_linear_bf16_block(const Int4LinearBf16Args& a, int64_t n0, int64_t n1,
                            uint16_t* wbuf) {
  const int64_t K = a.K, groups = K / a.group_size;
  for (int64_t n = n0; n < n1; n += kInt8RowsPerPass) {
    const int64_t nb = std::min<int64_t>(kInt8RowsPerPass, n1 - n);
    widen_int4_rows(a.q + n * (K / 2), a.scales + n * groups, a.zeros + n * groups, K,
                    a.group_size, nb, wbuf);
    const __mmask8 lanes = static_cast<__mmask8>((1u << nb) - 1u);
    const __m128 one = _mm_set1_ps(1.0f);
    const __m128 bias = a.bias != nullptr ? _mm_maskz_loadu_ps(lanes, a.bias + n)
                                          : _mm_setzero_ps();
    dot_rows(a.x, a.x_row_stride, a.M, K, wbuf, K, one, bias, nb, a.y + n, a.N);
  }
}

}  // namespace

Int8LinearBf16BlockFn int8_linear_bf16_avx512bf16() { return &int8_linear_bf16_block; }
Int4LinearBf16BlockFn int4_linear_bf16_avx512bf16() { return &int4_linear_bf16_block; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::Int8LinearBf16BlockFn vllm_lite::cpu::int8_linear_bf16_avx512bf16() {
  return nullptr;
}
vllm_lite::cpu::Int4LinearBf16BlockFn vllm_lite::cpu::int4_linear_bf16_avx512bf16() {
  return nullptr;
}
#endif
