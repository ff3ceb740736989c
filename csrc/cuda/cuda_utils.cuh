// Host-side helpers shared by the CUDA launchers.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/dtype.cuh"
#include "validate.h"

namespace vllm_lite {
namespace cuda {

// True while `stream` is capturing a CUDA graph: the launchers then skip the argument
// checks that read tensor values (they need a device sync, which capture forbids), and
// rely on the kernels' own bounds guards.
inline bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Whether the launchers run the argument checks that read tensor contents (slot mappings,
// block tables and sequence lengths, copy_blocks pairs) on CUDA: each copies to the host
// and syncs the device, too slow for every call on the hot path, so they are opt-in:
// VLLM_LITE_CHECK_VALUES=1 turns them on (read once, at the first call; the tests set
// it). Never while `stream` captures a graph. Without them a bad value still never makes a
// kernel touch memory outside its tensors (the kernels clamp lengths, skip bad slots and
// block pairs, read bad block ids as zeros); it only gives a wrong result.
inline bool check_values_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("VLLM_LITE_CHECK_VALUES");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return enabled;
}

inline bool should_check_values(cudaStream_t stream) {
  return check_values_enabled() && !stream_is_capturing(stream);
}

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(CT{}) with CT the cache element type of a kernel whose model dtype is T: T itself
// for kv_cache_dtype "auto", fp8_e4m3 / fp8_e5m2 for the fp8 kinds (uint8 caches; the
// shapes, the dtype and the head_size % 16 of the fp8 key layout are checked in
// validate.cpp).
template <typename T, typename Fn>
void dispatch_cache_elem(KvCacheDType kind, Fn&& f) {
  switch (kind) {
    case KvCacheDType::kFp8E4M3:
      f(fp8_e4m3{});
      return;
    case KvCacheDType::kFp8E5M2:
      f(fp8_e5m2{});
      return;
    case KvCacheDType::kAuto:
      f(T{});
      return;
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace vllm_lite
