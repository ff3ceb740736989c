// vllm_lite's kernels for C++: link vllm_lite::kernels (CMake package vllm_lite) and
// include this header.
//
// Linking the library registers the ops vllm_lite::paged_attention_v1, paged_attention_v2,
// reshape_and_cache, reshape_and_cache_flash, copy_blocks and swap_blocks (the schemas of
// torch.ops.vllm_lite.*) with torch's dispatcher, with a CPU kernel each and, in a build
// with CUDA kernels (VLLM_LITE_CUDA_KERNELS), a CUDA one; and int8_linear, CPU only.
//
// Call them as
//   vllm_lite::paged_attention_v1(out, query, key_cache, ...);   // any device
// Each function below has the signature of its declaration in <vllm_lite/ops.h> (tensor
// layouts documented there) and calls through the dispatcher, so one call serves CPU and
// CUDA tensors; the per-device functions vllm_lite::cpu::* / vllm_lite::cuda::* of ops.h
// skip the dispatcher. Invalid arguments throw c10::Error and change nothing.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include "vllm_lite/config.h"
#include "vllm_lite/cpu_isa.h"  // cpu_isas(), cpu_isa(), set_cpu_isa(): the CPU kernel's ISA
#include "vllm_lite/ops.h"

namespace vllm_lite {
namespace detail {

// A callable with the parameters of F (an op's function type in ops.h) that calls the
// dispatcher's op Name, looked up once.
template <const char* Name, class F>
struct DispatchedOp;

template <const char* Name, class R, class... Args>
struct DispatchedOp<Name, R(Args...)> {
  R operator()(Args... args) const {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<R(Args...)>();
    return op.call(args...);
  }
};

inline constexpr char kPagedAttentionV1[] = "vllm_lite::paged_attention_v1";
inline constexpr char kPagedAttentionV2[] = "vllm_lite::paged_attention_v2";
inline constexpr char kReshapeAndCache[] = "vllm_lite::reshape_and_cache";
inline constexpr char kReshapeAndCacheFlash[] = "vllm_lite::reshape_and_cache_flash";
inline constexpr char kCopyBlocks[] = "vllm_lite::copy_blocks";
inline constexpr char kSwapBlocks[] = "vllm_lite::swap_blocks";
inline constexpr char kInt8Linear[] = "vllm_lite::int8_linear";

}  // namespace detail

inline constexpr detail::DispatchedOp<detail::kPagedAttentionV1,
                                      decltype(cpu::paged_attention_v1)> paged_attention_v1{};
inline constexpr detail::DispatchedOp<detail::kPagedAttentionV2,
                                      decltype(cpu::paged_attention_v2)> paged_attention_v2{};
inline constexpr detail::DispatchedOp<detail::kReshapeAndCache,
                                      decltype(cpu::reshape_and_cache)> reshape_and_cache{};
inline constexpr detail::DispatchedOp<detail::kReshapeAndCacheFlash,
                                      decltype(cpu::reshape_and_cache_flash)>
    reshape_and_cache_flash{};
inline constexpr detail::DispatchedOp<detail::kCopyBlocks, decltype(cpu::copy_blocks)>
    copy_blocks{};
inline constexpr detail::DispatchedOp<detail::kSwapBlocks, decltype(cpu::swap_blocks)>
    swap_blocks{};
// CPU tensors only (no CUDA kernel; see ops.h).
inline constexpr detail::DispatchedOp<detail::kInt8Linear, decltype(cpu::int8_linear)>
    int8_linear{};

// Elements per 16-byte chunk of the paged key cache (its last dimension, x) for a dtype.
inline int64_t kv_cache_x(at::ScalarType dtype) {
  return 16 / static_cast<int64_t>(c10::elementSize(dtype));
}

}  // namespace vllm_lite
