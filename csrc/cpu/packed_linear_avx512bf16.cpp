// The bfloat16 kernel of packed_linear (AVX512-BF16): y = bf16(x W^T + bias) with float32
// accumulation, on the bf16 packed weight of packed_linear_params.h. The float32 kernel
// (packed_linear_avx512.cpp) is the same loop nest with FMAs on single k.
//
// Grid: the caller splits the panels (kPackedPanelCols output columns each) over threads;
// a call walks its panels in order once per block of rows and, per panel, the block's rows
// in tiles of kPackedTileRows (run_panels, packed_linear_params.h, shared with the float32
// kernel). A tile keeps rows x kPackedPanelVecs float32 accumulators in registers and
// runs K / 2 steps of: load the panel's 3 weight vectors (16 columns x a pair of k each),
// then per row broadcast the pair (x[m, 2j], x[m, 2j + 1]) and vdpbf16ps it into the
// row's 3 accumulators: 3 weight loads and rows broadcasts per 3 x rows products, no
// horizontal sums, outputs rounded once (vcvtneps2bf16, nearest even).
// Weights stream from memory once per call (the panel stays in L1/L2 for its row tiles),
// so a block's row tiles prefetch the next panel into L2 meanwhile (run_panels): at decode
// sizes the weights, not the arithmetic, are most of the time, and oneDNN's packed GEMM
// did not hide them (README "Linear-layer benchmark").
// Limits: K even (the pairs), rows of x contiguous within themselves; any M and N (the
// last panel's columns past N are zero in the weight and not stored).
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
#pragma clang attribute push(                                                           \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,prefer-vector-width=512")
#endif

#include "cpu/bf16_pairs.h"
#include "cpu/packed_dequant.h"
#include "cpu/packed_tile.h"
#include "cpu/packed_tile_bf16.h"

namespace vllm_lite::cpu {
namespace {

// Rows [0, R) of x (row stride xs) times one panel w; y's rows have stride N and this
// panel's columns start at y; `cols` of them are stored (< kPackedPanelCols in the last
// panel). next: the panel to prefetch into L2 meanwhile (nullptr: none).
struct Bf16Tile {
  static constexpr int64_t kRows = kPackedTileRows;
  template <int64_t R>
  static void tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K,
                   const float* scale, const float* bias, uint16_t* y, int64_t N,
                   int64_t cols, PanelPrefetch next, int64_t gated_cols) {
    __m512 acc[R][NV];
    init_acc(acc, scale, bias, cols);
    dot_pairs(acc, x, xs, w, 0, K / 2, next);
    store_bf16_tile(acc, scale, bias, y, N, cols, gated_cols);
  }
};

void bf16_linear_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  run_packed_panels<Bf16Tile, uint16_t>(a, p0, p1, (a.K / 2) * kPairStride);
}

// Rows [0, R) of x (R <= kQuantFusedRows) times panel p of a quantized weight, each packed
// row dequantized in registers and used at once: with so few rows, the buffer's store and
// reload were a fifth of the work.
struct Bf16QuantTile {
  template <int64_t R>
  static void tile(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p,
                   bool prefetch_next) {
    const uint16_t* x = static_cast<const uint16_t*>(a.x);
    const PanelOut o = panel_out(a, p);  // a quantized weight is never gated
    const __m512i interleave = pair_interleave();
    __m512 acc[R][NV];
    init_acc(acc, o.scale, o.bias, o.cols);
    dequant_panel(qw, p, a.N, a.K, prefetch_next,
                  [&](int64_t b, int64_t k, __m512 v0, __m512 v1) {
                    const __m512bh w = bf16_pairs(v0, v1, interleave);
                    for (int64_t r = 0; r < R; ++r) {
                      acc[r][b] = _mm512_dpbf16_ps(acc[r][b],
                                                   bcast_pair(x + r * a.x_row_stride + k), w);
                    }
                  });
    store_bf16(acc, o.scale, o.bias, static_cast<uint16_t*>(a.y) + o.y0, a.N, o.cols);
  }
};

void bf16_quant_linear_panels(const PackedLinearArgs& a, const PackedQuantWeight& qw,
                              int64_t p0, int64_t p1) {
  if (a.M <= kQuantFusedRows) {
    return quant_tile_passes<Bf16QuantTile, kQuantFusedRows, uint16_t>(a, qw, p0, p1);
  }
  uint16_t* buf = panel_buffer<uint16_t>((a.K / 2) * kPairStride);
  run_panels<Bf16Tile, uint16_t>(a, p0, p1, [&](int64_t p) {
    dequant_bf16_panel(qw, a.K, a.N, p, buf, p + 1 < p1);
    return PanelRef<uint16_t>{buf, nullptr};
  });
}

}  // namespace

PackedLinearFn packed_linear_bf16_avx512bf16() { return &bf16_linear_panels; }
PackedQuantLinearFn packed_quant_linear_bf16_avx512bf16() { return &bf16_quant_linear_panels; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::PackedLinearFn vllm_lite::cpu::packed_linear_bf16_avx512bf16() { return nullptr; }
vllm_lite::cpu::PackedQuantLinearFn vllm_lite::cpu::packed_quant_linear_bf16_avx512bf16() {
  return nullptr;
}
#endif
