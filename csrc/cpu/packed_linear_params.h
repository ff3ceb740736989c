// What the packed linear kernels (packed_linear_avx512bf16.cpp for bfloat16,
// packed_linear_avx512.cpp for float32) and their caller (packed_linear.cpp) share.
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

#include <cstdint>

namespace vllm_lite::cpu {

// Output columns per float32 accumulator vector, and vectors per panel.
constexpr int64_t kPackedVecCols = 16;
constexpr int64_t kPackedPanelVecs = 3;
constexpr int64_t kPackedPanelCols = kPackedVecCols * kPackedPanelVecs;
// Activation rows per register tile: kPackedTileRows x kPackedPanelVecs accumulators, the
// panel's vectors and one broadcast fit AVX-512's 32 registers.
constexpr int64_t kPackedTileRows = 8;
static_assert(kPackedTileRows * kPackedPanelVecs + kPackedPanelVecs + 1 <= 32);
// A call walks its panels once per block of rows of x, about this many bytes of x, so a
// prefill's rows stay in L2 while the panels pass (each panel is then reused by the
// block's row tiles from L1/L2; the weights are read once per block, from L3 after the
// first). Without blocks a 4096-row x streams from L3 once per panel; the blocks took a
// decoder layer's four GEMMs at 1381-4096 rows from 1.01-1.10x oneDNN's time to 0.97-1.06x
// (Zen 4 VM, 2 threads; small, but the same direction in every run).
constexpr int64_t kPackedRowBlockBytes = 256 * 1024;

// Rows per block for K elements of elem bytes: a multiple of kPackedTileRows, at least one
// tile.
constexpr int64_t packed_row_block(int64_t K, int64_t elem) {
  const int64_t rows = kPackedRowBlockBytes / (K * elem) / kPackedTileRows * kPackedTileRows;
  return rows > kPackedTileRows ? rows : kPackedTileRows;
}

struct PackedLinearArgs {
  const void* x;       // [M, K] in the weight's dtype, row stride x_row_stride
  const void* w;       // packed as above
  const float* bias;   // [N] or nullptr
  void* y;             // [M, N] in x's dtype, contiguous
  int64_t M, K, N, x_row_stride;
};

// Computes the panels [p0, p1) for every row of x.
using PackedLinearFn = void (*)(const PackedLinearArgs&, int64_t p0, int64_t p1);

// Each build's kernel; nullptr where it was compiled out (another architecture).
PackedLinearFn packed_linear_bf16_avx512bf16();
PackedLinearFn packed_linear_f32_avx512();

}  // namespace vllm_lite::cpu
