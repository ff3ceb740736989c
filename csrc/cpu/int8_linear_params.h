// What the int8 weight-only linear kernel builds (int8_linear_kernel.h, one per ISA) and
// their caller (int8_linear.cpp) share.
#pragma once

#include <cstdint>

namespace vllm_lite::cpu {

// Weight rows widened to float32 together and reused by every activation row; the kernel
// keeps one accumulator per row (its fast path is written for exactly 4).
constexpr int64_t kInt8RowsPerPass = 4;
// Output channels per parallel task: a multiple of kInt8RowsPerPass.
constexpr int64_t kInt8ChannelsPerTask = 32;
static_assert(kInt8ChannelsPerTask % kInt8RowsPerPass == 0);
// Up to this many activation rows the block kernel runs; more rows (prefills) dequantize
// the weight once and use the float32 GEMM, which blocks for its caches far better.
constexpr int64_t kInt8KernelMaxRows = 32;

struct Int8LinearArgs {
  const float* x;        // [M, K], row stride x_row_stride
  const int8_t* q;       // [N, K]
  const float* scales;   // [N], or [N, K / group_size] when group_size > 0
  const float* bias;     // [N] or nullptr
  float* y;              // [M, N]
  int64_t M, K, N, x_row_stride;
  int64_t group_size;    // 0: one scale per row
};

using Int8LinearBlockFn = void (*)(const Int8LinearArgs&, int64_t n0, int64_t n1, float* wbuf);

// int4_linear: the same passes and row limits as int8 (the kernel widens int4 rows instead).
struct Int4LinearArgs {
  const float* x;        // [M, K], row stride x_row_stride
  const uint8_t* q;      // [N, K / 2], two weights per byte (k = 2j low nibble)
  const float* scales;   // [N, K / group_size]
  const float* zeros;    // [N, K / group_size]
  const float* bias;     // [N] or nullptr
  float* y;              // [M, N]
  int64_t M, K, N, x_row_stride, group_size;
};

using Int4LinearBlockFn = void (*)(const Int4LinearArgs&, int64_t n0, int64_t n1, float* wbuf);

// int8_linear with bfloat16 activations (int8_linear_avx512bf16.cpp): x and y bf16 as raw
// uint16 bits; the kernel widens weights to bf16 into wbuf (kInt8RowsPerPass rows of
// int8_bf16_padded_k(K) elements) and has no row limit.
struct Int8LinearBf16Args {
  const uint16_t* x;     // [M, K], row stride x_row_stride
  const int8_t* q;       // [N, K]
  const float* scales;   // [N], or [N, K / group_size] when group_size > 0
  const float* bias;     // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t M, K, N, x_row_stride;
  int64_t group_size;    // 0: one scale per row
};

using Int8LinearBf16BlockFn = void (*)(const Int8LinearBf16Args&, int64_t n0, int64_t n1,
                                       uint16_t* wbuf);

// int4_linear with bfloat16 activations: the same kernel and wbuf (K is a multiple of 32).
struct Int4LinearBf16Args {
  const uint16_t* x;     // [M, K], row stride x_row_stride
  const uint8_t* q;      // [N, K / 2]
  const float* scales;   // [N, K / group_size]
  const float* zeros;    // [N, K / group_size]
  const float* bias;     // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t M, K, N, x_row_stride, group_size;
};

using Int4LinearBf16BlockFn = void (*)(const Int4LinearBf16Args&, int64_t n0, int64_t n1,
                                       uint16_t* wbuf);

// K rounded up to the bf16 kernel's 32-element vectors.
constexpr int64_t int8_bf16_padded_k(int64_t K) { return (K + 31) / 32 * 32; }

// Each build's kernel; nullptr where the build was compiled out (another architecture).
Int8LinearBlockFn int8_linear_generic();
Int8LinearBlockFn int8_linear_avx2();
Int4LinearBlockFn int4_linear_generic();
Int4LinearBlockFn int4_linear_avx2();
Int8LinearBf16BlockFn int8_linear_bf16_avx512bf16();
Int4LinearBf16BlockFn int4_linear_bf16_avx512bf16();

}  // namespace vllm_lite::cpu
