// Dequantizing one panel of an int8 / int4 weight (PackedQuantWeight,
// packed_linear_params.h) for the quantized entry points of the packed kernels: included by
// packed_linear_avx512.cpp (float32 panels) and packed_linear_avx512bf16.cpp (bfloat16
// panels) after their target pragma, so it is built under each file's instruction set
// (AVX-512F/BW/VL).
//
// A panel's kPackedPanelCols output columns are kPackedPanelVecs vectors of 16 lanes, a lane
// a column. Per vector, the 16 columns' rows of q are read 32 bytes at a time (masked
// loads: never past a row, nothing for a column past N) and transposed in registers into
// byte columns (transpose_16x32: byte b of the 16 rows in one 16-byte vector), which is the
// packed layout's column-per-lane order; each byte column widens to float32 vectors of the
// 16 columns' weights:
//   int8, per channel: q (exact; the caller's tiles apply the channel's scale to the sums);
//   int8, groups: q * scale[n, k / G], one rounding;
//   int4 (byte j: k = 2j low nibble, 2j + 1 high): q * scale[n, k / G] + zero[n, k / G], one
//         FMA (the dequantized float32 weight; a bf16 panel then rounds it once more, the
//         dequantized bf16 model's weight, as the row kernels do).
// Scales and zeros come by 16-lane gathers, once per group. Columns past N and k past q's K
// (up to the padded K the caller asks for) come out zero.
// Cost per 32 weights: about 7 (int8) / 3.5 (int4) shuffles of the transpose, then the
// widening, converts, scaling and stores: a fixed cost per call that the tiles' work must
// dwarf, so int8_linear runs this path only above a row count (int8_linear_params.h).
// Meanwhile the next panel's rows and scales are prefetched: with 16 rows read at a time
// the hardware prefetcher did not cover a panel's first lines (the default model's 120
// int8 projections at 31 bf16 rows: 30.2 ms without, 24.0 with).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/packed_linear_params.h"

// transpose_16x32's loops index vector arrays by the loop counter: fully unrolled (64
// shuffles), the indices are constants and the arrays stay in registers.
#if defined(__clang__)
#define VLLM_LITE_UNROLL _Pragma("unroll")
#else
#define VLLM_LITE_UNROLL _Pragma("GCC unroll 16")
#endif

namespace vllm_lite::cpu {
namespace {

// This thread's buffer of at least n elements, 64-byte aligned (a panel row is one cache
// line), kept for the thread's next calls: no allocation (and no page faults of a fresh
// mapping) per call.
template <typename T>
T* panel_buffer(int64_t n) {
  thread_local std::vector<T> buf;
  constexpr int64_t kAlign = 64 / sizeof(T);
  if (static_cast<int64_t>(buf.size()) < n + kAlign) buf.resize(static_cast<size_t>(n + kAlign));
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((addr + 63) & ~uintptr_t{63});
}

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

// Transposes 16 rows of 32 bytes (r[i]: row i) in place into 16 vectors of byte columns:
// afterwards r[i] holds byte i of the 16 rows in its low 128 bits and byte 16 + i in its
// high 128 bits. Four rounds of in-lane unpacks (bytes, words, dwords, qwords: 64 shuffles
// for 512 bytes), each 128-bit lane a 16 x 16 transpose of its own.
inline void transpose_16x32(__m256i r[16]) {
  __m256i t[16];
  VLLM_LITE_UNROLL
  for (int i = 0; i < 8; ++i) {  // t[i] / t[8 + i]: rows 2i, 2i + 1 at bytes 0-7 / 8-15
    t[i] = _mm256_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    t[8 + i] = _mm256_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  VLLM_LITE_UNROLL
  for (int h = 0; h < 2; ++h) {  // r[8h + 4s + q]: rows 4q .. 4q + 3 at bytes 8h + 4s + 0..3
    VLLM_LITE_UNROLL
    for (int q = 0; q < 4; ++q) {
      r[8 * h + q] = _mm256_unpacklo_epi16(t[8 * h + 2 * q], t[8 * h + 2 * q + 1]);
      r[8 * h + 4 + q] = _mm256_unpackhi_epi16(t[8 * h + 2 * q], t[8 * h + 2 * q + 1]);
    }
  }
  VLLM_LITE_UNROLL
  for (int hs = 0; hs < 4; ++hs) {  // t[4hs + 2u + o]: rows 8o .. 8o + 7 at bytes 4hs + 2u + 0..1
    VLLM_LITE_UNROLL
    for (int o = 0; o < 2; ++o) {
      t[4 * hs + o] = _mm256_unpacklo_epi32(r[4 * hs + 2 * o], r[4 * hs + 2 * o + 1]);
      t[4 * hs + 2 + o] = _mm256_unpackhi_epi32(r[4 * hs + 2 * o], r[4 * hs + 2 * o + 1]);
    }
  }
  VLLM_LITE_UNROLL
  for (int hsu = 0; hsu < 8; ++hsu) {  // r[2hsu + e]: rows 0..15 at byte 2hsu + e
    r[2 * hsu] = _mm256_unpacklo_epi64(t[2 * hsu], t[2 * hsu + 1]);
    r[2 * hsu + 1] = _mm256_unpackhi_epi64(t[2 * hsu], t[2 * hsu + 1]);
  }
}

// The 16 rows' chunk of 32 bytes at byte c0 (masked loads: never past a row, nothing for a
// dead column), transposed into cols: byte b of the 16 rows at cols + 16 * b.
inline void load_byte_columns(const uint8_t* q, int64_t row_bytes, int64_t c0, __mmask16 live,
                              bool prefetch_next, uint8_t* cols) {
  if (prefetch_next && (c0 & 63) == 0) {
    // The same rows of the next panel (kPackedPanelCols rows on), one line each: the gathers
    // of 16 rows at a time stream too many rows at once for the hardware prefetcher to
    // cover a panel's first lines, and the tiles after the dequantization do not overlap
    // with any load. A prefetch past the weight's end is dropped, not a fault.
    for (int i = 0; i < 16; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(q + (kPackedPanelCols + i) * row_bytes + c0),
                   _MM_HINT_T0);
    }
  }
  const int64_t left = row_bytes - c0;
  const __mmask32 bytes = left >= 32 ? ~__mmask32{0} : left > 0 ? (__mmask32{1} << left) - 1 : 0;
  __m256i r[16];
  VLLM_LITE_UNROLL
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm256_maskz_loadu_epi8((live >> i) & 1 ? bytes : 0, q + i * row_bytes + c0);
  }
  transpose_16x32(r);
  // r[i]: byte i in its low half, byte 16 + i in its high half
  VLLM_LITE_UNROLL
  for (int i = 0; i < 16; ++i) {
    _mm_store_si128(reinterpret_cast<__m128i*>(cols + 16 * i), _mm256_castsi256_si128(r[i]));
    _mm_store_si128(reinterpret_cast<__m128i*>(cols + 16 * (16 + i)), _mm256_extracti128_si256(r[i], 1));
  }
}

inline __m128i byte_column(const uint8_t* cols, int64_t b) {
  return _mm_load_si128(reinterpret_cast<const __m128i*>(cols + 16 * b));
}

// Calls emit(k, v0, v1) for k = 0, 2, 4, ... below kp (kp >= qw.K, rounded up to a chunk):
// v0 / v1 = the float32 weights W[n0 + c, k] / W[n0 + c, k + 1] of the 16 columns c (lane
// c; zero where c is not in `live` or k >= q's K). Each chunk of 32 bytes of the 16 rows
// (int8: 32 k; int4: 64 k) is read with masked loads (never past a row, or for a dead
// column) and transposed to byte columns (transpose_16x32).
// prefetch_next: meanwhile prefetch the same 16 columns of the next panel (its q rows, and
// its scales / zeros: the 16 rows' scales are 16 x groups floats, `groups` lines, one per
// group here).
template <typename Emit>
inline void dequant_columns(const PackedQuantWeight& qw, int64_t n0, __mmask16 live, int64_t kp,
                            bool prefetch_next, Emit&& emit) {
  const int64_t K = qw.K, G = qw.group_size, groups = G > 0 ? K / G : 0;
  // G is 32, 64 or 128: a shift and a mask instead of a division per step
  const int gshift = G > 0 ? __builtin_ctzll(static_cast<unsigned long long>(G)) : 0;
  const int64_t row_bytes = qw.int4 ? K / 2 : K;
  const uint8_t* q = static_cast<const uint8_t*>(qw.q) + n0 * row_bytes;
  const __m512i group_rows = lane_rows(groups);
  const float* scales = qw.scales != nullptr ? qw.scales + n0 * groups : nullptr;
  const float* zeros = qw.zeros != nullptr ? qw.zeros + n0 * groups : nullptr;
  const int64_t end_bytes = qw.int4 ? K / 2 : kp;  // kp > K only pads int8 (odd K, bf16)
  __m512 s = _mm512_setzero_ps(), z = _mm512_setzero_ps();
  alignas(64) uint8_t cols[32 * 16];
  for (int64_t c0 = 0; c0 < end_bytes; c0 += 32) {
    load_byte_columns(q, row_bytes, c0, live, prefetch_next, cols);
    if (qw.int4) {
      // byte j: k = 2j (low nibble), 2j + 1; G >= 32, so each half of the chunk (16 bytes,
      // 32 k, 16-aligned) lies within one group.
      const U8x16 low4 = U8x16{} + 0x0F;
      for (int64_t b = 0; b < 32; ++b) {
        const int64_t k = 2 * (c0 + b);
        if (k >= K) break;  // a last chunk of 16 bytes (K / 2 is a multiple of 16)
        if ((k & (G - 1)) == 0) {
          const int64_t g = k >> gshift;
          s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, group_rows, scales + g, 4);
          z = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, group_rows, zeros + g, 4);
          if (prefetch_next) {
            _mm_prefetch(reinterpret_cast<const char*>(scales + kPackedPanelCols * groups) + 64 * g, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(zeros + kPackedPanelCols * groups) + 64 * g, _MM_HINT_T0);
          }
        }
        const U8x16 v = (U8x16)byte_column(cols, b);
        emit(k, _mm512_fmadd_ps(uint8_to_f32((__m128i)(v & low4)), s, z),
             _mm512_fmadd_ps(uint8_to_f32((__m128i)(v >> 4)), s, z));
      }
    } else {
      for (int64_t b = 0; b < 32; b += 2) {
        const int64_t k = c0 + b;
        if (k >= kp) break;
        __m512 v0 = int8_to_f32(byte_column(cols, b)), v1 = int8_to_f32(byte_column(cols, b + 1));
        if (G > 0) {  // K is a multiple of G: whole chunks, each within one group
          if ((k & (G - 1)) == 0) {
            const int64_t g = k >> gshift;
            s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, group_rows, scales + g, 4);
            if (prefetch_next) {
              _mm_prefetch(reinterpret_cast<const char*>(scales + kPackedPanelCols * groups) + 64 * g, _MM_HINT_T0);
            }
          }
          v0 = _mm512_mul_ps(v0, s);
          v1 = _mm512_mul_ps(v1, s);
        }
        emit(k, v0, v1);
      }
    }
  }
}

// The 16-bit lane mask of the columns of vector b of a panel of `cols` stored columns.
inline __mmask16 live_cols(int64_t cols, int64_t b) {
  return static_cast<__mmask16>(packed_cols_mask(cols, b * kPackedVecCols));
}

}  // namespace
}  // namespace vllm_lite::cpu
