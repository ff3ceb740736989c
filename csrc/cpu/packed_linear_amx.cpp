// The bfloat16 kernel of packed_linear on AMX tiles (the "amxbf16" CPU build, cpu_isa.h):
// y = bf16(x W^T + bias) with float32 accumulation, on the same bf16 packed weight as the
// AVX512-BF16 kernel (packed_linear_params.h), whose rows are already AMX's B layout: 16
// rows of a panel's [k pair, 16 columns, 2] at the panel's row stride are one B tile
// (16 k pairs x 16 columns).
//
// Grid: as packed_linear_avx512bf16.cpp (the caller splits the panels over threads; per
// block of rows, per panel, the block's tiles of kTileRows rows). A tile is 16 rows x one
// panel: tmm0-2 accumulate the panel's three 16-column vectors (C, float32 16 x 16), tmm3
// holds 16 rows x 32 k of x (A), tmm4-6 the panel's three B tiles of the same 32 k; one
// step loads A and the three B and issues three tdpbf16ps. The C tiles go through a
// float32 buffer into the AVX-512 epilogue of the other kernel (packed_tile_bf16.h: bias,
// rounding, the gated silu * up), which also adds the K % 32 k the tiles leave (with
// vdpbf16ps, as that kernel does).
// Limits: K even (the pairs); any M (the last M % 16 rows are copied into a zeroed 16-row
// buffer, since an A tile reads 16 rows; below kAmxMinRows rows the AVX512-BF16 kernel
// runs) and N. The tile configuration is loaded per call
// on each thread and released at its end, so other code on the thread (oneDNN's AMX
// kernels) keeps its own.
// Standard headers come before the target pragma (packed_linear_avx512bf16.cpp says why).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/packed_linear_params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "cpu/gcc12_avx512.h"  // before the intrinsics: GCC 12's false warnings
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(                                                        \
    __attribute__((target(                                                           \
        "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,amx-tile,amx-bf16"))), \
    apply_to = function)
#else
#pragma GCC target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,amx-tile,amx-bf16,prefer-vector-width=512")
#endif

#include "cpu/bf16_pairs.h"
#include "cpu/packed_dequant.h"
#include "cpu/packed_tile.h"
#include "cpu/packed_tile_bf16.h"

namespace vllm_lite::cpu {
namespace {

constexpr int64_t kTileRows = 16;  // rows of an A and a C tile
constexpr int64_t kTileK = 32;     // k of an A tile's row and a B tile: 64 bytes of bf16
constexpr int64_t kTileBytes = 64;
constexpr int64_t kChunk = kTileK / 2 * kPairStride;  // a panel's bf16 per 32 k
static_assert(kPackedPanelVecs == 3 && kPackedVecCols * 4 == kTileBytes,
              "tmm0-2 are a panel's three 16-column vectors");

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-6 all 16 rows x 64 bytes (C, A, B as above).
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = kTileBytes;
  }
  // Not _tile_loadconfig: GCC 12's names only the operand's first 8 bytes as read, so the
  // compiler may drop the stores to the rest (a garbage configuration: SIGSEGV); here the
  // whole struct is the asm's input.
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// c [16, kPackedPanelCols] float32 = rows [0, 16) of x (row stride xs) times the panel w's
// first chunks * 32 k. next: what to prefetch into L2 meanwhile, a step per chunk.
inline void tile_sums(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t chunks,
                      float* c, const PanelPrefetch& next) {
  PanelPrefetcher<kChunk * 2> pf(next);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  const int64_t xb = xs * 2, wb = kPairStride * 2;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint16_t* wi = w + i * kChunk;
    pf.step();
    _tile_loadd(3, x + i * kTileK, xb);
    _tile_loadd(4, wi, wb);
    _tile_loadd(5, wi + kVecPairs, wb);
    _tile_loadd(6, wi + 2 * kVecPairs, wb);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  constexpr int64_t cb = kPackedPanelCols * 4;
  _tile_stored(0, c, cb);
  _tile_stored(1, c + kPackedVecCols, cb);
  _tile_stored(2, c + 2 * kPackedVecCols, cb);
}

// Rows [0, R) of a tile into y: their sums c (row stride kPackedPanelCols) plus the bias,
// plus k in [k0, K) (the k past the tiles) with vdpbf16ps, stored as the AVX512-BF16
// kernel stores (store_bf16_tile).
template <int64_t R>
void finish_rows(const float* c, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t k0,
                 int64_t K, const float* scale, const float* bias, uint16_t* y, int64_t N,
                 int64_t cols, int64_t gated_cols) {
  __m512 acc[R][NV];
  init_acc(acc, scale, bias, cols);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < NV; ++b) {
      acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_load_ps(c + r * kPackedPanelCols + b * kPackedVecCols));
    }
  }
  dot_pairs(acc, x, xs, w, k0 / 2, K / 2, PanelPrefetch{});
  store_bf16_tile(acc, scale, bias, y, N, cols, gated_cols);
}

// finish_rows<rows> for 1 <= rows <= R.
template <int64_t R>
void finish_of(int64_t rows, const float* c, const uint16_t* x, int64_t xs, const uint16_t* w,
               int64_t k0, int64_t K, const float* scale, const float* bias, uint16_t* y,
               int64_t N, int64_t cols, int64_t gated_cols) {
  if constexpr (R > 0) {
    if (rows == R) return finish_rows<R>(c, x, xs, w, k0, K, scale, bias, y, N, cols, gated_cols);
    finish_of<R - 1>(rows, c, x, xs, w, k0, K, scale, bias, y, N, cols, gated_cols);
  }
}

// Rows per block of x (packed_row_block's, in whole tiles).
int64_t amx_row_block(int64_t K) {
  return std::max(kTileRows, kPackedRowBlockBytes / (K * 2) / kTileRows * kTileRows);
}

// run_panels (packed_linear_params.h) on AMX tiles: panel_of(p) -> PanelRef<uint16_t>.
template <typename PanelOf>
void run_amx_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1, PanelOf&& panel_of) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  uint16_t* y = static_cast<uint16_t*>(a.y);
  const int64_t chunks = a.K / kTileK, k0 = chunks * kTileK;
  // x's last M % 16 rows, zero-padded to a whole tile.
  const int64_t full = a.M / kTileRows * kTileRows;
  const uint16_t* last = nullptr;
  if (full < a.M) {
    uint16_t* buf = panel_buffer<uint16_t, 1>(kTileRows * a.K);
    const int64_t rows = a.M - full;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(buf + r * a.K, x + (full + r) * a.x_row_stride, sizeof(uint16_t) * a.K);
    }
    std::memset(buf + rows * a.K, 0, sizeof(uint16_t) * (kTileRows - rows) * a.K);
    asm volatile("" ::: "memory");  // the tile loads' asm does not name the memory it reads
    last = buf;
  }
  alignas(64) float c[kTileRows * kPackedPanelCols];
  if (chunks == 0) std::memset(c, 0, sizeof(c));
  configure_tiles();
  const int64_t block = amx_row_block(a.K);
  for (int64_t m0 = 0; m0 < a.M; m0 += block) {
    const int64_t m1 = std::min(a.M, m0 + block);
    // Only a block of one tile prefetches the next panel: sharing the prefetch between
    // tiles as run_panels does (PanelPrefetch) made the AMX tiles slower with the weights
    // streaming from memory.
    const bool prefetch = m1 - m0 <= kTileRows;
    for (int64_t p = p0; p < p1; ++p) {
      const PanelOut o = panel_out(a, p);
      const PanelRef<uint16_t> w = panel_of(p);
      for (int64_t m = m0; m < m1; m += kTileRows) {
        const int64_t rows = std::min(kTileRows, m1 - m);
        const uint16_t* xt = m < full ? x + m * a.x_row_stride : last;
        const int64_t xs = m < full ? a.x_row_stride : a.K;
        if (chunks > 0) {
          tile_sums(xt, xs, w.w, chunks, c,
                    PanelPrefetch::part(prefetch ? w.next : nullptr, chunks, kChunk * 2, 0, 1));
        }
        for (int64_t r = 0; r < rows; r += kPackedTileRows) {
          finish_of<kPackedTileRows>(std::min(kPackedTileRows, rows - r), c + r * kPackedPanelCols,
                                     xt + r * xs, xs, w.w, k0, a.K, o.scale, o.bias,
                                     y + (m + r) * a.N + o.y0, a.N, o.cols, o.gated_cols);
        }
      }
    }
  }
  _tile_release();
}

// Below this many rows of x the AVX512-BF16 kernel runs instead: a tile's 16 rows cost
// the same for 1 row, and there the vector kernel streams the weights a little faster;
// at 2 rows the two are about even, and from 3 rows the tiles win.
constexpr int64_t kAmxMinRows = 3;

void amx_linear_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  if (a.M < kAmxMinRows) return packed_linear_bf16_avx512bf16()(a, p0, p1);
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const int64_t panel = (a.K / 2) * kPairStride;
  run_amx_panels(a, p0, p1, [&](int64_t p) {
    return PanelRef<uint16_t>{w + p * panel, p + 1 < p1 ? w + (p + 1) * panel : nullptr};
  });
}

// A quantized weight: up to kQuantFusedRows rows the AVX512-BF16 kernel's registers-only
// path (no panel buffer to fill for so few rows), else each panel dequantized into this
// thread's buffer and run on the tiles.
void amx_quant_linear_panels(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p0,
                             int64_t p1) {
  if (a.M <= kQuantFusedRows) return packed_quant_linear_bf16_avx512bf16()(a, qw, p0, p1);
  uint16_t* buf = panel_buffer<uint16_t>((a.K / 2) * kPairStride);
  run_amx_panels(a, p0, p1, [&](int64_t p) {
    dequant_bf16_panel(qw, a.K, a.N, p, buf, p + 1 < p1);
    asm volatile("" ::: "memory");  // as above: the tiles read buf
    return PanelRef<uint16_t>{buf, nullptr};
  });
}

}  // namespace

PackedLinearFn packed_linear_bf16_amx() { return &amx_linear_panels; }
PackedQuantLinearFn packed_quant_linear_bf16_amx() { return &amx_quant_linear_panels; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::PackedLinearFn vllm_lite::cpu::packed_linear_bf16_amx() { return nullptr; }
vllm_lite::cpu::PackedQuantLinearFn vllm_lite::cpu::packed_quant_linear_bf16_amx() {
  return nullptr;
}
#endif
