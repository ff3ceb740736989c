// What the packed linear kernels (packed_linear_avx512bf16.cpp for bfloat16,
// packed_linear_avx512.cpp for float32, packed_linear_avx2.cpp for both on AVX2) and their
// caller (packed_linear.cpp) share.
//
// Packed weight layouts, panel p holding output columns [p * kPackedPanelCols,
// (p + 1) * kPackedPanelCols) of W [N, K] (nn.Linear's layout, y = x W^T), zero for the
// columns past N:
//   bfloat16 [panels, K / 2, kPackedPanelCols, 2]: [p, j, c, e] = W[p * cols + c, 2 j + e]
//     (K even); one 64-byte row [j, 16 columns, 2] is what vdpbf16ps multiplies by a
//     broadcast pair (x[m, 2j], x[m, 2j + 1]);
//   float32 [panels, K, kPackedPanelCols]: [p, k, c] = W[p * cols + c, k]; one 64-byte row
//     [k, 16 columns] is what an FMA multiplies by a broadcast x[m, k].
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace vllm_lite::cpu {

// Output columns per float32 accumulator vector, and vectors per panel.
constexpr int64_t kPackedVecCols = 16;
constexpr int64_t kPackedPanelVecs = 3;
constexpr int64_t kPackedPanelCols = kPackedVecCols * kPackedPanelVecs;
// Outputs per panel of a gated weight (packed_gated_linear): half its columns are gate
// features, half up (packed_tile.h's store_gated).
constexpr int64_t kGatedPanelCols = kPackedPanelCols / 2;
// Activation rows per register tile: kPackedTileRows x kPackedPanelVecs accumulators, the
// panel's vectors and one broadcast fit AVX-512's 32 registers.
constexpr int64_t kPackedTileRows = 8;
static_assert(kPackedTileRows * kPackedPanelVecs + kPackedPanelVecs + 1 <= 32);
// A call walks its panels once per block of rows of x, about this many bytes of x, so a
// prefill's rows stay in L2 while the panels pass (each panel is then reused by the
// block's row tiles from L1/L2; the weights are read once per block, from L3 after the
// first). Without blocks a 4096-row x streams from L3 once per panel (the blocks' gain
// is small but was the same in every run). Groups of panels kept in L2 across the blocks
// were slower: x was then read from L3 once per group.
constexpr int64_t kPackedRowBlockBytes = 256 * 1024;

// The lanes of vector c0 / kPackedVecCols (its first column c0) that hold one of a panel's
// `cols` stored columns: a 16-bit lane mask for the kernels' masked bias loads and stores.
constexpr uint32_t packed_cols_mask(int64_t cols, int64_t c0) {
  return cols >= c0 + kPackedVecCols ? 0xFFFFu
         : cols > c0                 ? (1u << (cols - c0)) - 1u
                                     : 0u;
}

// Rows per block for K elements of elem bytes: a multiple of kPackedTileRows, at least one
// tile.
constexpr int64_t packed_row_block(int64_t K, int64_t elem) {
  const int64_t rows = kPackedRowBlockBytes / (K * elem) / kPackedTileRows * kPackedTileRows;
  return rows > kPackedTileRows ? rows : kPackedTileRows;
}


struct PackedLinearArgs {
  const void* x;       // [M, K] in the weight's dtype, row stride x_row_stride
  const void* w;       // packed as above (nullptr for a quantized weight: PackedQuantWeight)
  const float* bias;   // [N] or nullptr
  void* y;             // [M, N] in x's dtype, contiguous
  int64_t M, K, N, x_row_stride;
  // [N] or nullptr: y = scale * (x W^T) + bias (int8_linear's per-channel scales, applied
  // to the exact sums of x times the int8 weights).
  const float* scale = nullptr;
  // The weight is gated (packed_gated_linear): y [M, N] = silu(gate) * up, panel p's
  // kGatedPanelCols outputs from its gate and up columns; bias (with the weight's
  // columns, all panels full) as for a plain weight; no scale.
  bool gated = false;
};

// A weight-only quantized weight packed by pack_linear_weight like a float32 weight (one
// byte per k of a column for int8, per pair of k for int4: [panels, K or K / 2, 48] bytes),
// which the quantized entry points dequantize one panel at a time (packed_dequant.h) into a
// per-thread buffer in the float layout above, then run the same tiles on (up to
// kQuantFusedRows rows of x, kQuantFusedRowsF32 in float32: straight into the tiles'
// accumulators, no buffer).
struct PackedQuantWeight {
  const void* q;         // int8 [panels, K, cols] or uint8 [panels, K / 2, cols] (byte j of a
                         // column: k = 2j in its low nibble, 2j + 1 in its high one)
  const float* scales;   // [N, K / group_size]; int8 with group_size 0: nullptr (args.scale)
  const float* zeros;    // int4: [N, K / group_size]; int8: nullptr
  int64_t K;             // q's K: PackedLinearArgs::K may be one more (a bf16 x padded to even K)
  int64_t group_size;    // 0 (int8 per channel) or 32 / 64 / 128
  bool int4;
};

// Bytes of one step of a tile through its panel: one k of a float32 panel, one k pair of a
// bfloat16 one (kPackedPanelCols columns x 4 bytes either way), three cache lines.
constexpr int64_t kPackedRowBytes = kPackedPanelCols * 4;

// The share of the next panel that one row tile prefetches into L2 while it runs (see
// run_panels): tile t of a block's T takes the next panel's steps from t S / T on (S steps
// of step_bytes), one every T of its own S steps, so the block's tiles together stream the
// whole next panel at an even rate over the current panel's compute.
struct PanelPrefetch {
  const char* at = nullptr;  // the first step to prefetch; nullptr: none
  int64_t every = 1;

  static PanelPrefetch part(const void* next, int64_t steps, int64_t step_bytes, int64_t t,
                            int64_t tiles) {
    if (next == nullptr) return {};
    return {static_cast<const char*>(next) + t * steps / tiles * step_bytes, tiles};
  }
};

// A tile loop's prefetcher: step() once per step of StepBytes. The loop keeps the state in
// these locals: stepping PanelPrefetch's own fields (passed by value), or a second copy of
// the loop without prefetches, made the float32 tile slower at every size, though the hot
// loop's instructions looked the same.
template <int64_t StepBytes>
struct PanelPrefetcher {
  const char* at;
  int64_t every, countdown = 1;
  explicit PanelPrefetcher(const PanelPrefetch& p) : at(p.at), every(p.every) {}
  inline void step() {
    if (at == nullptr || --countdown > 0) return;
    countdown = every;
    for (int64_t l = 0; l < StepBytes; l += 64) __builtin_prefetch(at + l, 0, 2);  // T1: L2
    at += StepBytes;
  }
};

// The loop nest of the vector kernels, built under each kernel file's target: per block of
// rows (packed_row_block), per panel of [p0, p1), the block's tiles of Kernel::kRows rows
// (kPackedTileRows on AVX-512; fewer where there are fewer registers, packed_linear_avx2.cpp)
// and one tile of the rest, Kernel::tile<R> computing R rows of one panel (T = the element
// type). The block's tiles prefetch the next panel into L2 meanwhile, shared between them
// (PanelPrefetch): at decode sizes the weights stream from memory, and a lone first tile
// prefetching the whole next panel left blocks of 2-4 tiles waiting for their weights
// (12 rows took far longer than 8). At prefill sizes the shared prefetches cost nothing
// measurable. One tile's whole panel at once stalled the tile with a burst of prefetches;
// the shares come one row at a time.
// gated_cols: 0 for a plain weight; for a gated one (args.gated) the panel's outputs,
// which the tile stores through store_gated (packed_tile.h) instead.
template <typename Kernel, int64_t R, typename T>
inline void tile_of(int64_t rows, const T* x, int64_t xs, const T* w, int64_t K,
                    const float* scale, const float* bias, T* y, int64_t N, int64_t cols,
                    PanelPrefetch next, int64_t gated_cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      return Kernel::template tile<R>(x, xs, w, K, scale, bias, y, N, cols, next, gated_cols);
    }
    tile_of<Kernel, R - 1>(rows, x, xs, w, K, scale, bias, y, N, cols, next, gated_cols);
  }
}

// One panel's packed weight for the tiles, and the next panel's to prefetch (or nullptr).
template <typename T>
struct PanelRef {
  const T* w;
  const T* next;
};

// Where panel p's results go: its first weight column n0 (bias and scale start there), its
// first output column y0, the columns a tile computes (cols) and, for a gated weight, the
// outputs it stores (gated_cols; 0 for a plain weight, whose tile stores `cols`).
struct PanelOut {
  int64_t n0, y0, cols, gated_cols;
  const float* bias;   // or nullptr
  const float* scale;  // or nullptr
};

inline PanelOut panel_out(const PackedLinearArgs& a, int64_t p) {
  const int64_t n0 = p * kPackedPanelCols;
  const int64_t y0 = a.gated ? p * kGatedPanelCols : n0;
  const int64_t out_cols = std::min(a.gated ? kGatedPanelCols : kPackedPanelCols, a.N - y0);
  return {n0, y0, a.gated ? kPackedPanelCols : out_cols, a.gated ? out_cols : 0,
          a.bias != nullptr ? a.bias + n0 : nullptr, a.scale != nullptr ? a.scale + n0 : nullptr};
}

// panel_of(p) -> PanelRef<T>: the packed weight (PanelRef{w + p * panel, ...}) or a panel
// dequantized into a buffer (packed_dequant.h).
template <typename Kernel, typename T, typename PanelOf>
inline void run_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1, PanelOf&& panel_of) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const int64_t block = packed_row_block(a.K, sizeof(T));
  // The panel's steps of kPackedRowBytes (K float32 rows, K / 2 bfloat16 pair rows).
  const int64_t steps = a.K * static_cast<int64_t>(sizeof(T)) * kPackedPanelCols / kPackedRowBytes;
  constexpr int64_t TR = Kernel::kRows;
  static_assert(kPackedTileRows % TR == 0, "a row block is a whole number of tiles");
  for (int64_t m0 = 0; m0 < a.M; m0 += block) {
    const int64_t m1 = std::min(a.M, m0 + block);
    const int64_t tiles = (m1 - m0 + TR - 1) / TR;
    for (int64_t p = p0; p < p1; ++p) {
      const PanelOut o = panel_out(a, p);
      const PanelRef<T> w = panel_of(p);
      for (int64_t m = m0, t = 0; m < m1; m += TR, ++t) {
        const PanelPrefetch share = PanelPrefetch::part(w.next, steps, kPackedRowBytes, t, tiles);
        tile_of<Kernel, TR>(std::min(TR, m1 - m),
                                         x + m * a.x_row_stride, a.x_row_stride, w.w, a.K,
                                         o.scale, o.bias, y + m * a.N + o.y0, a.N, o.cols, share,
                                         o.gated_cols);
      }
    }
  }
}

// run_panels on a packed weight of `panel` elements per panel.
template <typename Kernel, typename T>
inline void run_packed_panels(const PackedLinearArgs& a, int64_t p0, int64_t p1, int64_t panel) {
  const T* w = static_cast<const T*>(a.w);
  run_panels<Kernel, T>(a, p0, p1, [&](int64_t p) {
    return PanelRef<T>{w + p * panel, p + 1 < p1 ? w + (p + 1) * panel : nullptr};
  });
}

// Up to this many rows of x, the quantized entry points dequantize each packed row of a
// panel in registers and use it at once (no buffer); more rows share a dequantized panel.
// At 1-4 rows the buffer's store and reload are a large share of the work; 5-6 rows in
// registers made int8 a little faster but int4 slower (its scales and zeros hold 6 more
// registers), so 4.
constexpr int64_t kQuantFusedRows = 4;
static_assert(kQuantFusedRows * kPackedPanelVecs + kPackedPanelVecs + 4 <= 32);
// The float32 kernels (AVX-512, AVX2) go on in registers up to this many rows of an int8
// weight, in passes of their tile rows that each dequantize the panel again: their buffer
// costs more than the extra passes (docs/results/linear.md measures 5-8 rows). An int4
// panel's dequantizing (a scale and a zero per group) costs more than the buffer past 4
// rows, and the bfloat16 kernel's passes gained nothing.
constexpr int64_t kQuantFusedRowsF32 = 2 * kQuantFusedRows;

// Kernel::tile<rows>(a, qw, p, prefetch_next) for 1 <= rows <= R: the quantized entry
// points' registers-only tiles (up to kQuantFusedRows rows of x times panel p, each packed
// row of the panel dequantized and used at once).
template <typename Kernel, int64_t R>
inline void quant_tile_of(int64_t rows, const PackedLinearArgs& a, const PackedQuantWeight& qw,
                          int64_t p, bool prefetch_next) {
  if constexpr (R > 0) {
    if (rows == R) return Kernel::template tile<R>(a, qw, p, prefetch_next);
    quant_tile_of<Kernel, R - 1>(rows, a, qw, p, prefetch_next);
  }
}

// The panels [p0, p1) for every row of x (elements T) by quant_tile_of, in passes of R rows
// that each dequantize the panel again (its bytes then in L1 / L2); the first pass
// prefetches the next panel.
template <typename Kernel, int64_t R, typename T>
inline void quant_tile_passes(const PackedLinearArgs& a, const PackedQuantWeight& qw,
                              int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m0 = 0; m0 < a.M; m0 += R) {
      PackedLinearArgs rows = a;
      rows.M = std::min(R, a.M - m0);
      rows.x = static_cast<const T*>(a.x) + m0 * a.x_row_stride;
      rows.y = static_cast<T*>(a.y) + m0 * a.N;
      quant_tile_of<Kernel, R>(rows.M, rows, qw, p, m0 == 0 && p + 1 < p1);
    }
  }
}

// This thread's buffer of at least n elements, 64-byte aligned (so each 16-column vector of
// a panel row is one cache line), kept for the thread's next calls: no allocation (and no
// page faults of a fresh mapping) per call. Slot: another buffer of the same type, used
// alongside (packed_linear_amx.cpp's copy of x's last rows). Defined here, under the default
// target: GCC 13 refuses std::vector's always_inline members parsed under a kernel file's
// target pragma.
template <typename T, int Slot = 0>
T* panel_buffer(int64_t n) {
  thread_local std::vector<T> buf;
  constexpr int64_t kAlign = 64 / sizeof(T);
  if (static_cast<int64_t>(buf.size()) < n + kAlign) buf.resize(static_cast<size_t>(n + kAlign));
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((addr + 63) & ~uintptr_t{63});
}

// Computes the panels [p0, p1) for every row of x.
using PackedLinearFn = void (*)(const PackedLinearArgs&, int64_t p0, int64_t p1);
// The same on a quantized weight (args.w unused).
using PackedQuantLinearFn = void (*)(const PackedLinearArgs&, const PackedQuantWeight&,
                                     int64_t p0, int64_t p1);

// Each build's kernels; nullptr where they were compiled out (another architecture).
PackedLinearFn packed_linear_bf16_avx512bf16();
PackedLinearFn packed_linear_bf16_amx();
PackedLinearFn packed_linear_f32_avx512();
PackedLinearFn packed_linear_bf16_avx2();
PackedLinearFn packed_linear_f32_avx2();
PackedQuantLinearFn packed_quant_linear_bf16_avx512bf16();
PackedQuantLinearFn packed_quant_linear_bf16_amx();
PackedQuantLinearFn packed_quant_linear_f32_avx512();
PackedQuantLinearFn packed_quant_linear_f32_avx2();

}  // namespace vllm_lite::cpu
