// The float32 and bfloat16 kernels of packed_linear / packed_gated_linear on AVX2 + FMA (the
// "avx2" build and every wider one that VLLM_LITE_CPU_ISA / set_cpu_isa narrows to it):
// y = x W^T + bias with float32 accumulation, on the same packed weights as the AVX-512
// kernels (packed_linear_params.h), so a packed weight does not depend on the kernel that
// runs it.
//
// Layouts: float32 [panels, K, 48]: one k of a panel is 6 ymm vectors of 8 columns; bfloat16
// [panels, K / 2, 48, 2]: one k pair is 6 ymm rows of [8 columns, 2], each 32-bit lane a
// column's pair (W[n, 2j] in its low half, W[n, 2j + 1] in its high half). A bf16 row
// expands to two float32 vectors without rounding: the low halves shifted left by 16, the
// high halves masked, so the products are the exact ones vdpbf16ps forms (results equal the
// AVX512-BF16 kernel's up to summation order); each output is rounded to bf16 once, at the
// store (nearest even, bf16_bits).
//
// Grid: run_panels (packed_linear_params.h) as for the AVX-512 kernels: the caller splits
// the panels over torch's threads, a call walks its panels once per block of rows, per
// panel the block's rows in tiles of kRows, and the tiles prefetch the next panel into L2.
// A tile holds kRows x 6 accumulators: with 16 ymm registers that is 2 rows (12
// accumulators, a broadcast of x per row, one weight vector at a time). A bf16 tile runs
// each k pair as two passes over the 6 vectors (the even k, then the odd k), so only two
// broadcasts are live, not four: the pair's 192 bytes are read twice from L1 instead.
// Limits: as the AVX-512 kernels (rows of x contiguous within themselves, bf16 K even, any
// M and N; the last panel's columns past N are zero in the weight and not stored).
// Quantized weights (packed_quant_linear, float32 x): int8 / int4 panels dequantized a
// vector at a time (dequant_panel) straight into the accumulators for a decode's few rows
// (kQuantFusedRows, int8 kQuantFusedRowsF32), into a panel buffer for the float32 tiles
// past that.
// Standard headers come before the target pragma, under the default target.
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/packed_linear_params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include "cpu/vec.h"

namespace vllm_lite::cpu {
namespace {

constexpr int64_t kLanes = 8;                          // float32 per ymm
constexpr int64_t NV = kPackedPanelCols / kLanes;      // vectors per panel row
constexpr int64_t kGatedVecs = kGatedPanelCols / kLanes;  // a gated panel's gate vectors
constexpr int64_t kTileRows = 2;
static_assert(kTileRows * NV + kTileRows + 1 <= 16, "a tile's accumulators, broadcasts, one weight");
static_assert(NV == 2 * kGatedVecs, "gate vectors, then as many up vectors");
constexpr int64_t kPairStride = kPackedPanelCols * 2;  // bf16 per k pair of a panel

using V8 = Vec<float, kLanes>;
using I8 = Vec<int32_t, kLanes>;
using U8 = Vec<uint32_t, kLanes>;

// The first n (0..8) floats at p, zero after them.
VLLM_LITE_INLINE __m256 load_first(const float* p, int64_t n) {
  if (n >= kLanes) return _mm256_loadu_ps(p);
  alignas(32) float t[kLanes] = {};
  std::memcpy(t, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(float));
  return _mm256_load_ps(t);
}

// The columns of vector b that are stored: `cols` of the panel's.
constexpr int64_t vector_cols(int64_t cols, int64_t b) {
  return std::clamp<int64_t>(cols - b * kLanes, 0, kLanes);
}

// Every row's accumulators start at the bias (zero without one).
template <int64_t R>
VLLM_LITE_INLINE void init_acc(__m256 (&acc)[R][NV], const float* bias, int64_t cols) {
#pragma GCC unroll 8
  for (int64_t b = 0; b < NV; ++b) {
    const __m256 v = bias != nullptr ? load_first(bias + b * kLanes, vector_cols(cols, b))
                                     : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) acc[r][b] = v;
  }
}

// The accumulators into sums (memory, for the epilogue). Every access to the accumulators
// has a constant index once these loops are unrolled, so they stay in registers: the
// epilogue's own loops (not unrolled: silu is long) indexed them at run time at first,
// and GCC then kept them in memory, stored at every k (half the speed).
template <int64_t R>
VLLM_LITE_INLINE void spill_acc(const __m256 (&acc)[R][NV], float (&sums)[R][NV][kLanes]) {
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int64_t b = 0; b < NV; ++b) _mm256_store_ps(sums[r][b], acc[r][b]);
  }
}

// A vector's first n outputs of row r: 8 floats (float32) or 8 bf16 (bfloat16, nearest even).
VLLM_LITE_INLINE void store_out(float* y, __m256 v, int64_t n) {
  if (n >= kLanes) return _mm256_storeu_ps(y, v);
  alignas(32) float t[kLanes];
  _mm256_store_ps(t, v);
  std::memcpy(y, t, static_cast<size_t>(n) * sizeof(float));
}
VLLM_LITE_INLINE void store_out(uint16_t* y, __m256 v, int64_t n) {
  const U8 bits = bf16_bits<U8>((V8)v);
  // the low halves of the 8 lanes, in order: 16 bytes
  const __m256i packed = _mm256_packus_epi32((__m256i)bits, (__m256i)bits);  // per 128-bit half
  const __m128i lo = _mm_unpacklo_epi64(_mm256_castsi256_si128(packed),
                                        _mm256_extracti128_si256(packed, 1));
  if (n >= kLanes) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), lo);
  alignas(16) uint16_t t[kLanes];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), lo);
  std::memcpy(y, t, static_cast<size_t>(n) * sizeof(uint16_t));
}

// The output rounding of each type: none in float32, bf16 (nearest even) in bfloat16, as a
// float32 vector (the gated epilogue rounds the projection and the silu as the unfused
// packed_linear then silu_and_mul do).
VLLM_LITE_INLINE V8 round_as(const float*, V8 v) { return v; }
VLLM_LITE_INLINE V8 round_as(const uint16_t*, V8 v) { return (V8)(bf16_bits<U8>(v) << 16); }

// A tile's R rows into y (row stride N): the panel's `cols` columns, or for a gated weight
// (gated_cols > 0 outputs; vectors 0-2 the gate features, 3-5 the up ones)
// silu(gate) * up, each factor rounded as the unfused ops round it. sums: spill_acc's.
template <int64_t R, typename T>
VLLM_LITE_INLINE void store_tile(const float (&sums)[R][NV][kLanes], T* y, int64_t N,
                                 int64_t cols, int64_t gated_cols) {
  const auto acc = [&](int64_t r, int64_t b) { return _mm256_load_ps(sums[r][b]); };
  for (int64_t r = 0; r < R; ++r) {
    if (gated_cols > 0) {
      for (int64_t b = 0; b < kGatedVecs; ++b) {
        const int64_t n = vector_cols(gated_cols, b);
        if (n == 0) break;
        const V8 g = round_as(y, (V8)acc(r, b)), u = round_as(y, (V8)acc(r, b + kGatedVecs));
        const V8 s = round_as(y, silu<V8, I8>(g));
        store_out(y + r * N + b * kLanes, (__m256)(s * u), n);
      }
      continue;
    }
    for (int64_t b = 0; b < NV; ++b) {
      const int64_t n = vector_cols(cols, b);
      if (n == 0) break;
      store_out(y + r * N + b * kLanes, acc(r, b), n);
    }
  }
}

// sums = sums * scale + bias over the panel's `cols` columns (int8's per-channel scales,
// one FMA each as the AVX-512 kernels' store_acc).
template <int64_t R>
VLLM_LITE_INLINE void scale_sums(float (&sums)[R][NV][kLanes], const float* scale,
                                 const float* bias, int64_t cols) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float& v = sums[r][c / kLanes][c % kLanes];
      v = std::fma(v, scale[c], bias != nullptr ? bias[c] : 0.f);
    }
  }
}

// Rows [0, R) of x (row stride xs) times one panel w; y's rows have stride N and this
// panel's columns start at y. next: the panel to prefetch into L2 meanwhile.
struct F32Tile {
  static constexpr int64_t kRows = kTileRows;
  template <int64_t R>
  static void tile(const float* x, int64_t xs, const float* w, int64_t K, const float* scale,
                   const float* bias, float* y, int64_t N, int64_t cols, PanelPrefetch next,
                   int64_t gated_cols) {
    __m256 acc[R][NV];
    // int8's per-channel scales (the quantized entry point) multiply the sums at the end,
    // so the bias is added there too.
    init_acc(acc, scale != nullptr ? nullptr : bias, cols);
    PanelPrefetcher<kPackedRowBytes> pf(next);
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * kPackedPanelCols;
      pf.step();
      __m256 xv[R];
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ss(x + r * xs + k);
#pragma GCC unroll 8
      for (int64_t b = 0; b < NV; ++b) {
        const __m256 wv = _mm256_loadu_ps(wk + b * kLanes);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(xv[r], wv, acc[r][b]);
      }
    }
    alignas(32) float sums[R][NV][kLanes];
    spill_acc(acc, sums);
    if (scale != nullptr) scale_sums(sums, scale, bias, cols);
    store_tile(sums, y, N, cols, gated_cols);
  }
};

struct Bf16Tile {
  static constexpr int64_t kRows = kTileRows;
  template <int64_t R>
  static void tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K,
                   const float* scale, const float* bias, uint16_t* y, int64_t N, int64_t cols,
                   PanelPrefetch next, int64_t gated_cols) {
    (void)scale;
    __m256 acc[R][NV];
    init_acc(acc, bias, cols);
    PanelPrefetcher<kPackedRowBytes> pf(next);
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t j = 0; j < K / 2; ++j) {
      const uint16_t* wj = w + j * kPairStride;
      pf.step();
      __m256i xp[R];  // row r's pair (x[2j], x[2j + 1]) in every lane
      for (int64_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * xs + 2 * j, sizeof(pair));
        xp[r] = _mm256_set1_epi32(pair);
      }
      __m256 xv[R];
      for (int64_t r = 0; r < R; ++r) xv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xp[r], 16));
#pragma GCC unroll 8
      for (int64_t b = 0; b < NV; ++b) {  // k = 2j: the low halves
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj) + b);
        const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(xv[r], wv, acc[r][b]);
      }
      for (int64_t r = 0; r < R; ++r) xv[r] = _mm256_castsi256_ps(_mm256_and_si256(xp[r], high));
#pragma GCC unroll 8
      for (int64_t b = 0; b < NV; ++b) {  // k = 2j + 1: the high halves
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj) + b);
        const __m256 wv = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(xv[r], wv, acc[r][b]);
      }
    }
    alignas(32) float sums[R][NV][kLanes];
    spill_acc(acc, sums);
    store_tile(sums, y, N, cols, gated_cols);
  }
};

void f32_linear_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  run_packed_panels<F32Tile, float>(a, p0, p1, a.K * kPackedPanelCols);
}

void bf16_linear_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1) {
  run_packed_panels<Bf16Tile, uint16_t>(a, p0, p1, (a.K / 2) * kPairStride);
}

// Calls emit(b, k, v) for every k of panel p of a packed int8 / int4 weight
// (PackedQuantWeight) and its vectors b = 0 .. NV - 1: v = the float32 weights W[n, k] of
// vector b's 8 columns, as packed_dequant.h gives them on AVX-512: int8 per channel q (the
// tiles apply the scale to the sums), int8 groups q * scale, int4 q * scale + zero (one
// FMA); columns past N come out zero (zero bytes, zero scales). A group's scales and zeros
// of the panel's columns are gathered once into a small array.
template <typename Emit>
VLLM_LITE_INLINE void dequant_panel(const PackedQuantWeight& qw, int64_t N, int64_t p,
                                    Emit&& emit) {
  constexpr int64_t W = kPackedPanelCols;
  const int64_t K = qw.K, G = qw.group_size, groups = G > 0 ? K / G : 0;
  const int64_t rows = qw.int4 ? K / 2 : K, n0 = p * W, cols = std::min(W, N - n0);
  const uint8_t* q = static_cast<const uint8_t*>(qw.q) + p * rows * W;
  alignas(32) float s[W] = {}, z[W] = {};
  const auto load_group = [&](int64_t g) {
    for (int64_t c = 0; c < cols; ++c) {
      s[c] = qw.scales[(n0 + c) * groups + g];
      if (qw.zeros != nullptr) z[c] = qw.zeros[(n0 + c) * groups + g];
    }
  };
  const auto bytes8 = [&](int64_t row, int64_t b) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + row * W + b * kLanes));
  };
  if (qw.int4) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t k = 2 * j;
      if (k % G == 0) load_group(k / G);
#pragma GCC unroll 8
      for (int64_t b = 0; b < NV; ++b) {
        const __m256i v = _mm256_cvtepu8_epi32(bytes8(j, b));
        const __m256 sv = _mm256_load_ps(s + b * kLanes), zv = _mm256_load_ps(z + b * kLanes);
        emit(b, k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), sv, zv));
        emit(b, k + 1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), sv, zv));
      }
    }
    return;
  }
  for (int64_t k = 0; k < K; ++k) {
    if (G > 0 && k % G == 0) load_group(k / G);
#pragma GCC unroll 8
    for (int64_t b = 0; b < NV; ++b) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(k, b)));
      emit(b, k, G > 0 ? _mm256_mul_ps(v, _mm256_load_ps(s + b * kLanes)) : v);
    }
  }
}

// Up to kTileRows rows of x times panel p of a quantized weight, each dequantized vector
// used at once (no buffer): the FMAs of F32Tile on the buffer, in the same k order.
struct F32QuantTile {
  template <int64_t R>
  static void tile(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p,
                   bool /*prefetch_next*/) {
    const float* x = static_cast<const float*>(a.x);
    const PanelOut o = panel_out(a, p);  // a quantized weight is never gated
    __m256 acc[R][NV];
    init_acc(acc, o.scale != nullptr ? nullptr : o.bias, o.cols);
    dequant_panel(qw, a.N, p, [&](int64_t b, int64_t k, __m256 v) {
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        acc[r][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * a.x_row_stride + k), v,
                                    acc[r][b]);
      }
    });
    alignas(32) float sums[R][NV][kLanes];
    spill_acc(acc, sums);
    if (o.scale != nullptr) scale_sums(sums, o.scale, o.bias, o.cols);
    store_tile(sums, static_cast<float*>(a.y) + o.y0, a.N, o.cols, 0);
  }
};

// The quantized entry point (packed_quant_linear): a few rows F32QuantTile, more each panel
// dequantized into this thread's buffer and the float32 tiles run on it.
void f32_quant_linear_panels(const PackedLinearArgs& a, const PackedQuantWeight& qw, int64_t p0,
                             int64_t p1) {
  // The AVX-512 float32 kernel's row limits (packed_linear_params.h), in passes of this
  // kernel's 2-row tile: measured the same way here.
  if (a.M <= (qw.int4 ? kQuantFusedRows : kQuantFusedRowsF32)) {
    return quant_tile_passes<F32QuantTile, kTileRows, float>(a, qw, p0, p1);
  }
  float* buf = panel_buffer<float>(a.K * kPackedPanelCols);
  run_panels<F32Tile, float>(a, p0, p1, [&](int64_t p) {
    dequant_panel(qw, a.N, p, [&](int64_t b, int64_t k, __m256 v) {
      _mm256_store_ps(buf + k * kPackedPanelCols + b * kLanes, v);
    });
    return PanelRef<float>{buf, nullptr};
  });
}

}  // namespace

PackedLinearFn packed_linear_f32_avx2() { return &f32_linear_panels; }
PackedLinearFn packed_linear_bf16_avx2() { return &bf16_linear_panels; }
PackedQuantLinearFn packed_quant_linear_f32_avx2() { return &f32_quant_linear_panels; }

}  // namespace vllm_lite::cpu

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
vllm_lite::cpu::PackedLinearFn vllm_lite::cpu::packed_linear_f32_avx2() { return nullptr; }
vllm_lite::cpu::PackedLinearFn vllm_lite::cpu::packed_linear_bf16_avx2() { return nullptr; }
vllm_lite::cpu::PackedQuantLinearFn vllm_lite::cpu::packed_quant_linear_f32_avx2() {
  return nullptr;
}
#endif
