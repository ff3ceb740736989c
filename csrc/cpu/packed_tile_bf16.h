// The bfloat16 side of the packed GEMM tiles, shared by the AVX512-BF16 kernel
// (packed_linear_avx512bf16.cpp) and the AMX one (packed_linear_amx.cpp): the vdpbf16ps
// loop over a panel's k pairs, the rounding of a tile's float32 accumulators into y, plain
// or gated, and a quantized panel dequantized into the bf16 packed layout. Included after
// packed_tile.h, under an AVX512-BF16 target.
#pragma once

#include <cstdint>

#include "cpu/bf16_pairs.h"
#include "cpu/packed_dequant.h"
#include "cpu/packed_linear_params.h"
#include "cpu/packed_tile.h"
#include "cpu/vec.h"

namespace vllm_lite::cpu {
namespace {

constexpr int64_t NV = kPackedPanelVecs;
constexpr int64_t kPairStride = kPackedPanelCols * 2;  // bf16 per k pair of a panel
constexpr int64_t kVecPairs = kPackedVecCols * 2;      // bf16 per 64-byte row (16 columns)

// acc[r] += row r of x (rows [0, R), stride xs) times the panel w's k pairs [j0, j1): per
// pair, the panel's 3 weight vectors (16 columns x a pair of k each) and per row a
// broadcast pair into vdpbf16ps. next: what to prefetch into L2 meanwhile, a step per pair.
template <int64_t R>
inline void dot_pairs(__m512 (&acc)[R][NV], const uint16_t* x, int64_t xs, const uint16_t* w,
                      int64_t j0, int64_t j1, const PanelPrefetch& next) {
  PanelPrefetcher<kPackedRowBytes> pf(next);
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* wj = w + j * kPairStride;
    pf.step();
    __m512bh wv[NV];
    for (int64_t b = 0; b < NV; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wj + b * kVecPairs);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xv = bcast_pair(x + r * xs + 2 * j);
      for (int64_t b = 0; b < NV; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
}

// y = bf16(acc) (nearest even), rows of stride N, the panel's `cols` columns.
template <int64_t R>
void store_bf16(__m512 (&acc)[R][NV], const float* scale, const float* bias, uint16_t* y,
                int64_t N, int64_t cols) {
  store_acc(acc, scale, bias, cols, [&](int64_t r, int64_t c0, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(y + r * N + c0, m, (__m256i)_mm512_cvtneps_pbh(v));
  });
}

// store_gated's rounding in bfloat16: the projection's output as store_bf16 rounds it
// (vcvtneps2bf16), the silu as silu_and_mul rounds it (nearest even, bf16_bits).
struct Bf16Round {
  static __m512 output(__m512 v) {
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  static __m512 act(__m512 v) {
    return (__m512)(bf16_bits<Vec<uint32_t, kPackedVecCols>>((Vec<float, kPackedVecCols>)v) << 16);
  }
};

// A tile's R rows of one panel into y: store_bf16, or for a gated weight (gated_cols > 0
// outputs) silu(gate) * up through store_gated.
template <int64_t R>
void store_bf16_tile(__m512 (&acc)[R][NV], const float* scale, const float* bias, uint16_t* y,
                     int64_t N, int64_t cols, int64_t gated_cols) {
  if (gated_cols > 0) {
    store_gated<Bf16Round>(acc, gated_cols, [&](int64_t r, int64_t c0, __mmask16 m, __m512 v) {
      const auto bits = bf16_bits<Vec<uint32_t, kPackedVecCols>>((Vec<float, kPackedVecCols>)v);
      _mm256_mask_storeu_epi16(y + r * N + c0, m, _mm512_cvtepi32_epi16((__m512i)bits));
    });
    return;
  }
  store_bf16(acc, scale, bias, y, N, cols);
}

// Panel p of a quantized weight, dequantized into buf in the bf16 packed layout (K even,
// the caller's: x padded by one zero column when q's K is odd, whose weights are zero).
inline void dequant_bf16_panel(const PackedQuantWeight& qw, int64_t K, int64_t N, int64_t p,
                               uint16_t* buf, bool prefetch_next) {
  const __m512i interleave = pair_interleave();
  dequant_panel(qw, p, N, K, prefetch_next, [&](int64_t b, int64_t k, __m512 v0, __m512 v1) {
    _mm512_store_si512(buf + k / 2 * kPairStride + b * kVecPairs,
                       (__m512i)bf16_pairs(v0, v1, interleave));
  });
}

}  // namespace
}  // namespace vllm_lite::cpu
