// Host-side helpers shared by the torch-facing code of the CUDA ops (the *_ops.cpp files;
// the .cu files include no torch header: see launch_types.h).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/launch_types.h"
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

// The kernels' element type of a tensor's dtype; any other dtype fails naming op.
inline FloatType to_float_type(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat:
      return FloatType::kFloat32;
    case at::kHalf:
      return FloatType::kFloat16;
    case at::kBFloat16:
      return FloatType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": dtype ", t, " is not supported; use float32, float16 or bfloat16");
  }
}

}  // namespace cuda
}  // namespace vllm_lite
