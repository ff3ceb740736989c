// The AVX2 + FMA build of the CPU element-wise kernels, chosen at run time on CPUs that
// have them. The target applies to this file alone; standard headers come first, under the
// default target.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define VLLM_LITE_ELEMENTWISE_FN elementwise_avx2
#define VLLM_LITE_VEC_WIDTH 8
#include "cpu/elementwise_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
#include "cpu/elementwise_params.h"
vllm_lite::cpu::ElementwiseFns vllm_lite::cpu::elementwise_avx2() { return {}; }
#endif
