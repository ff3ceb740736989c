// What the host side of a CUDA op passes to its kernel launchers. The .cu files that hold
// kernels include no torch header (nvcc spends most of a translation unit's time compiling
// ATen's headers otherwise); the torch-facing code (argument checks, device guard, current
// stream, dtype mapping) lives in .cpp files compiled by the host compiler, and calls the
// launchers declared in each kernel family's *_launch.h with raw pointers, sizes and these
// enums. A launcher returns the launch's cudaError_t; the caller checks it.
#pragma once

#include <cstdint>

#include "kv_cache_dtype.h"

namespace vllm_lite {
namespace cuda {

// The element type of a kernel's floating-point tensors (float, __half, __nv_bfloat16).
enum class FloatType { kFloat32, kFloat16, kBFloat16 };

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace vllm_lite
