// fused_moe's GEMM for experts with few rows (cpu/fused_moe.cpp) on builds without a
// packed kernel for the dtype: y = x W^T for a range of W's rows, W in its plain [N, K]
// layout (the expert's slice of w13 / w2). A decode step gives each expert one to a few
// rows, so the step streams every chosen expert's weights once from memory: the kernel
// reads a few rows of W at a time and holds all of x's rows against them, where at::mm
// pays its per-call set-up per expert and per thread split.
#pragma once

#include <cstdint>

namespace vllm_lite::cpu {

// Rows of x per block: the kernel walks its range of W once per block of x (a block's
// float32 rows stay in L2 while the range's W rows pass, each group of W rows from L1 for
// every pair of the block's rows).
constexpr int64_t kMoeRowsGemmBlockRows = 16;
// float32 experts with more rows take at::mm: its blocked GEMM reads W once for all rows.
// bfloat16 experts take the kernel at any row count: without AVX512-BF16, at::mm's
// bfloat16 GEMM was slower than it at every size.
constexpr int64_t kMoeRowsGemmMaxRowsF32 = kMoeRowsGemmBlockRows;

// y[m, n - n0] (row stride ldy, in W's dtype: float32 or bfloat16, rounded to nearest even
// once) = sum_k x[m, k] * w[n, k] for m < M, n in [n0, n1); x float32 [M, K] contiguous,
// w [N, K] contiguous, accumulated in float32. Any M.
using MoeRowsGemmFn = void (*)(const float* x, int64_t M, int64_t K, const void* w, void* y,
                               int64_t ldy, int64_t n0, int64_t n1);

// The AVX2 + FMA build's (nullptr when compiled for another architecture).
MoeRowsGemmFn moe_rows_gemm_f32_avx2();
MoeRowsGemmFn moe_rows_gemm_bf16_avx2();

}  // namespace vllm_lite::cpu
