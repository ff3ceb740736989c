// The accumulator set-up and epilogue that the packed GEMM tiles share: included by
// packed_linear_avx512.cpp (float32) and packed_linear_avx512bf16.cpp (bfloat16) after their
// target pragma, so it is built under each file's instruction set (AVX-512F). A tile holds
// R rows x kPackedPanelVecs float32 accumulators, vector b holding the panel's columns
// [16 b, 16 b + 16), of which `cols` are stored.
#pragma once

#include <cstdint>

#include "cpu/packed_linear_params.h"

namespace vllm_lite::cpu {
namespace {

// The lanes of vector b that hold one of the panel's `cols` stored columns.
inline __mmask16 vector_cols_mask(int64_t cols, int64_t b) {
  return static_cast<__mmask16>(packed_cols_mask(cols, b * kPackedVecCols));
}

// Every row's accumulators start at the bias, or at zero where a per-column scale (int8's
// per-channel scales) is applied to the sums at the end.
template <int64_t R, int64_t NV>
inline void init_acc(__m512 (&acc)[R][NV], const float* scale, const float* bias, int64_t cols) {
  for (int64_t b = 0; b < NV; ++b) {
    const __m512 v = bias != nullptr && scale == nullptr
                         ? _mm512_maskz_loadu_ps(vector_cols_mask(cols, b), bias + b * kPackedVecCols)
                         : _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) acc[r][b] = v;
  }
}

// Per vector with stored columns: acc = acc * scale + bias where scale is given, then
// store(r, c0, m, acc[r][b]) writes row r's columns [c0, c0 + 16) under lane mask m.
template <int64_t R, int64_t NV, typename Store>
inline void store_acc(__m512 (&acc)[R][NV], const float* scale, const float* bias, int64_t cols,
                      Store&& store) {
  for (int64_t b = 0; b < NV; ++b) {
    const int64_t c0 = b * kPackedVecCols;
    if (cols <= c0) break;
    const __mmask16 m = vector_cols_mask(cols, b);
    if (scale != nullptr) {
      const __m512 sv = _mm512_maskz_loadu_ps(m, scale + c0);
      const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(acc[r][b], sv, bv);
    }
    for (int64_t r = 0; r < R; ++r) store(r, c0, m, acc[r][b]);
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
