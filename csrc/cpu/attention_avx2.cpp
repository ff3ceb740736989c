// The AVX2 + FMA build of the CPU attention kernels (paged decode and varlen prefill),
// chosen at run time on CPUs that have them; decode over bfloat16 caches uses
// attention_bf16_avx2.h. The target applies to this file alone, so the library still loads
// on any x86-64.
// Standard headers first, under the default target: only this file's own functions get the
// wider instruction set.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>  // its intrinsics carry their own target attributes
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define VLLM_LITE_ISA_FN attention_task_avx2
#define VLLM_LITE_VARLEN_ISA_FN varlen_task_avx2
#define VLLM_LITE_VEC_WIDTH 8
#define VLLM_LITE_BF16_AVX2 1  // bf16 decode: attention_bf16_avx2.h
#include "cpu/attention_kernel.h"
#include "cpu/varlen_attention_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
#include "cpu/attention_params.h"
vllm_lite::cpu::AttentionTaskFn vllm_lite::cpu::attention_task_avx2() { return nullptr; }
vllm_lite::cpu::VarlenTaskFn vllm_lite::cpu::varlen_task_avx2() { return nullptr; }
#endif
