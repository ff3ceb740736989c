// The AVX-512 + BF16 build of the CPU attention kernels (paged decode and varlen prefill):
// decode over bfloat16 caches uses the vdpbf16ps dot products of attention_bf16dp.h,
// everything else the AVX-512 code. Chosen at run time on
// CPUs with AVX-512F/BW/VL/DQ and AVX512_BF16. The target applies to this file alone.
// Standard headers first, under the default target: only this file's own functions get the
// wider instruction set.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "cpu/gcc12_avx512.h"  // before the intrinsics: GCC 12's false warnings
#include <immintrin.h>  // its intrinsics carry their own target attributes
#if defined(__clang__)
#pragma clang attribute push(                                                        \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,prefer-vector-width=512")
#endif
#define VLLM_LITE_ISA_FN attention_task_avx512bf16
#define VLLM_LITE_VARLEN_ISA_FN varlen_task_avx512bf16
#define VLLM_LITE_VEC_WIDTH 16
#define VLLM_LITE_BF16_DOT 1
#include "cpu/attention_kernel.h"
#include "cpu/varlen_attention_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
#include "cpu/attention_params.h"
vllm_lite::cpu::AttentionTaskFn vllm_lite::cpu::attention_task_avx512bf16() { return nullptr; }
vllm_lite::cpu::VarlenTaskFn vllm_lite::cpu::varlen_task_avx512bf16() { return nullptr; }
#endif
