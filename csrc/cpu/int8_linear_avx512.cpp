// The AVX-512 build (512-bit vectors) of the int8 / int4 weight-only linear kernels, chosen
// at run time on CPUs with AVX-512F/BW/VL/DQ: the `omp simd` loops widen and multiply 16
// weights per instruction instead of AVX2's 8. The target applies to this file alone;
// standard headers come first, under the default target.
#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
#endif
#define VLLM_LITE_INT8_FN int8_linear_avx512
#define VLLM_LITE_INT4_FN int4_linear_avx512
#include "cpu/int8_linear_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
#include "cpu/int8_linear_params.h"
vllm_lite::cpu::Int8LinearBlockFn vllm_lite::cpu::int8_linear_avx512() { return nullptr; }
vllm_lite::cpu::Int4LinearBlockFn vllm_lite::cpu::int4_linear_avx512() { return nullptr; }
#endif
