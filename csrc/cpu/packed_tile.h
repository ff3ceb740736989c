// The accumulator set-up and epilogue that the packed GEMM tiles share: included by
// packed_linear_avx512.cpp (float32) and packed_linear_avx512bf16.cpp (bfloat16) after their
// target pragma, so it is built under each file's instruction set (AVX-512F). A tile holds
// R rows x kPackedPanelVecs float32 accumulators, vector b holding the panel's columns
// [16 b, 16 b + 16), of which `cols` are stored.
#pragma once

#include <cstdint>

#include "cpu/packed_linear_params.h"
#include "cpu/vec.h"

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

// A gated panel (packed_gated_linear; rows ordered by ops.gated_panel_rows): columns
// [0, kGatedPanelCols) are the gate features of kGatedPanelCols outputs and the next
// kGatedPanelCols their up features, so vector 1 holds the last 8 gate columns and the
// first 8 up ones.
static_assert(kPackedPanelVecs == 3 && kGatedPanelCols == 24, "store_gated's lane split");

// silu(gate) * up of a tile's rows (the bias already in the accumulators: init_acc),
// through store(r, c0, m, v) for the panel's out_cols (<= kGatedPanelCols) outputs. The
// rounding is silu_and_mul's on the unfused projection's output, so both give the same
// bits: Round::output(v) is the projection's rounding of its output (identity in
// float32, vcvtneps2bf16 in bfloat16), Round::act(v) silu_and_mul's of the silu
// (elementwise_kernel.h's Lanes::round); store rounds the product to the output type.
template <typename Round, int64_t R, typename Store>
inline void store_gated(__m512 (&acc)[R][kPackedPanelVecs], int64_t out_cols, Store&& store) {
  using V = Vec<float, kPackedVecCols>;
  using I = Vec<int32_t, kPackedVecCols>;
  const __mmask16 masks[2] = {static_cast<__mmask16>(packed_cols_mask(out_cols, 0)),
                              static_cast<__mmask16>(packed_cols_mask(out_cols, kPackedVecCols))};
  for (int64_t r = 0; r < R; ++r) {
    const __m512i a1 = _mm512_castps_si512(acc[r][1]), a2 = _mm512_castps_si512(acc[r][2]);
    const __m512 gate[2] = {acc[r][0], acc[r][1]};
    const __m512 up[2] = {_mm512_castsi512_ps(_mm512_alignr_epi32(a2, a1, 8)),   // up 0..15
                          _mm512_castsi512_ps(_mm512_alignr_epi32(a2, a2, 8))};  // up 16..23
    for (int64_t h = 0; h < 2 && h * kPackedVecCols < out_cols; ++h) {
      const V g = (V)Round::output(gate[h]), u = (V)Round::output(up[h]);
      const V s = (V)Round::act((__m512)silu<V, I>(g));
      store(r, h * kPackedVecCols, masks[h], (__m512)(s * u));
    }
  }
}

}  // namespace
}  // namespace vllm_lite::cpu
