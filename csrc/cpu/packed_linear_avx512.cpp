// The float32 kernel of packed_linear (AVX-512F): y = x W^T + bias on the float32 packed
// weight of packed_linear_params.h, the loop nest of the bfloat16 kernel
// (packed_linear_avx512bf16.cpp, whose header comment describes the grid and the
// prefetch; run_panels) with one k per step: load the panel's 3 weight vectors (16 columns
// each), then per row broadcast x[m, k] and FMA it into the row's 3 accumulators. Limits: rows of x contiguous within
// themselves; any M, K and N (the last panel's columns past N are zero and not stored).
// Chosen at run time on CPUs with AVX-512F/BW/VL/DQ (the "avx512" and "avx512bf16" builds).
// Standard headers come before the target pragma, under the default target: GCC 13 refuses
// std::vector's always_inline allocator members parsed under it (packed_dequant.h's
// buffer), "target specific option mismatch".
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/packed_linear_params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "cpu/gcc12_avx512.h"  // before the intrinsics: GCC 12's false warnings
#include <immintrin.h>  // its intrinsics carry their own target attributes
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
#endif

#include "cpu/packed_dequant.h"
#include "cpu/packed_tile.h"

namespace vllm_lite::cpu {
namespace {

constexpr int64_t NV = kPackedPanelVecs;

// store_gated's rounding in float32: none.
struct F32Round {
  static __m512 output(__m512 v) { return v; }
  static __m512 act(__m512 v) { return v; }
};

// Rows [0, R) of x times one panel w (see the bf16 kernel's tile).
struct F32Tile {
  static constexpr int64_t kRows = kPackedTileRows;
  template <int64_t R>
  static void tile(const float* x, int64_t xs, const float* w, int64_t K, const float* scale,
                   const float* bias, float* y, int64_t N, int64_t cols, PanelPrefetch next,
                   int64_t gated_cols) {
    __m512 acc[R][NV];
    init_acc(acc, scale, bias, cols);
    PanelPrefetcher<kPackedRowBytes> pf(next);
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * kPackedPanelCols;
      pf.step();
      __m512 wv[NV];
      for (int64_t b = 0; b < NV; ++b) wv[b] = _mm512_loadu_ps(wk + b * kPackedVecCols);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * xs + k]);
        for (int64_t b = 0; b < NV; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
      }
    }
    const auto store = [&](int64_t r, int64_t c0, __mmask16 m, __m512 v) {
      _mm512_mask_storeu_ps(y + r * N + c0, m, v);
    };
    if (gated_cols > 0) return store_gated<F32Round>(acc, gated_cols, store);
    store_acc(acc, scale, bias, cols, store);
  }
};

void f32_linear_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  run_packed_panels<F32Tile, float>(a, p0, p1, a.K * kPackedPanelCols);
}

// Panel p of a quantized weight, dequantized into buf in the float32 packed layout (buf
// holds K + 1 rows: an odd K's last pair stores a zero row past the panel).
void dequant_f32_panel(const PackedQuantWeight& qw, int64_t K, int64_t N, int64_t p, float* buf,
                       bool prefetch_next) {
  dequant_panel(qw, p, N, K, prefetch_next, [&](int64_t b, int64_t k, __m512 v0, __m512 v1) {
    float* out = buf + k * kPackedPanelCols + b * kPackedVecCols;
    _mm512_store_ps(out, v0);
    _mm512_store_ps(out + kPackedPanelCols, v1);
  });
}

// Rows [0, R) of x (R <= kQuantFusedRows) times panel p of a quantized weight, each packed
// row dequantized in registers and used at once, as the bf16 kernel's Bf16QuantTile: the
// same FMAs in the same k order as F32Tile on the dequantized buffer, so the same bits,
// without the buffer's store and reload (most of the work at so few rows).
struct F32QuantTile {
  template <int64_t R>
  static void tile(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p,
                   bool prefetch_next) {
    const float* x = static_cast<const float*>(a.x);
    const PanelOut o = panel_out(a, p);  // a quantized weight is never gated
    const int64_t K = a.K;
    __m512 acc[R][NV];
    init_acc(acc, o.scale, o.bias, o.cols);
    dequant_panel(qw, p, a.N, K, prefetch_next,
                  [&](int64_t b, int64_t k, __m512 v0, __m512 v1) {
                    for (int64_t r = 0; r < R; ++r) {
                      const float* xr = x + r * a.x_row_stride + k;
                      acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), v0, acc[r][b]);
                      // an odd K's last step has no k + 1 (in x or the weight)
                      if (k + 1 < K) {
                        acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), v1, acc[r][b]);
                      }
                    }
                  });
    float* y = static_cast<float*>(a.y) + o.y0;
    store_acc(acc, o.scale, o.bias, o.cols, [&](int64_t r, int64_t c0, __mmask16 m, __m512 v) {
      _mm512_mask_storeu_ps(y + r * a.N + c0, m, v);
    });
  }
};

void f32_quant_linear_panels(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p0,
                             int64_t p1) {
  if (a.M <= (qw.int4 ? kQuantFusedRows : kQuantFusedRowsF32)) {
    return quant_tile_passes<F32QuantTile, kQuantFusedRows, float>(a, qw, p0, p1);
  }
  float* buf = panel_buffer<float>((a.K + 1) * kPackedPanelCols);
  run_panels<F32Tile, float>(a, p0, p1, [&](int64_t p) {
    dequant_f32_panel(qw, a.K, a.N, p, buf, p + 1 < p1);
    return PanelRef<float>{buf, nullptr};
  });
}

}  // namespace

PackedLinearFn packed_linear_f32_avx512() { return &f32_linear_panels; }
PackedQuantLinearFn packed_quant_linear_f32_avx512() { return &f32_quant_linear_panels; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::PackedLinearFn vllm_lite::cpu::packed_linear_f32_avx512() { return nullptr; }
vllm_lite::cpu::PackedQuantLinearFn vllm_lite::cpu::packed_quant_linear_f32_avx512() {
  return nullptr;
}
#endif
