// What the packed bfloat16 linear kernel (bf16_linear_avx512bf16.cpp) and its caller
// (bf16_linear.cpp) share.
//
// Packed weight layout: [panels, K / 2, kBf16PanelCols, 2] bf16. Panel p holds output
// columns [p * kBf16PanelCols, (p + 1) * kBf16PanelCols) of W [N, K] (nn.Linear's layout,
// y = x W^T): element [p, j, c, e] = W[p * kBf16PanelCols + c, 2 j + e], zero for the
// columns past N. One 64-byte row [j, 16 columns, 2] is what vdpbf16ps multiplies by a
// broadcast pair (x[m, 2j], x[m, 2j + 1]). K must be even.
#pragma once

#include <cstdint>

namespace vllm_lite::cpu {

// Output columns per float32 accumulator vector, and vectors per panel.
constexpr int64_t kBf16VecCols = 16;
constexpr int64_t kBf16PanelVecs = 3;
constexpr int64_t kBf16PanelCols = kBf16VecCols * kBf16PanelVecs;
// Activation rows per register tile: kBf16TileRows x kBf16PanelVecs accumulators, the
// panel's vectors and one broadcast fit AVX-512's 32 registers.
constexpr int64_t kBf16TileRows = 8;
static_assert(kBf16TileRows * kBf16PanelVecs + kBf16PanelVecs + 1 <= 32);

struct Bf16LinearArgs {
  const uint16_t* x;   // [M, K] bf16 bits, row stride x_row_stride
  const uint16_t* w;   // packed as above
  const float* bias;   // [N] or nullptr
  uint16_t* y;         // [M, N] bf16 bits, contiguous
  int64_t M, K, N, x_row_stride;
};

// Computes the panels [p0, p1) for every row of x.
using Bf16LinearFn = void (*)(const Bf16LinearArgs&, int64_t p0, int64_t p1);

// The AVX512-BF16 build; nullptr where it was compiled out (another architecture).
Bf16LinearFn bf16_linear_avx512bf16();

}  // namespace vllm_lite::cpu
