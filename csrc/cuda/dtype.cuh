// Element types of the CUDA kernels and their float32 conversions.
//
// Kernels are templated on the CUDA-native element type (float, __half, __nv_bfloat16);
// launchers map at::ScalarType to it with VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES. All math is
// float32: loads convert to float, stores round to nearest even. torch compiles CUDA with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so every conversion here
// is an explicit intrinsic or bit operation, never an implicit cast.
//
// A "chunk" is 16 bytes (one uint4 load): 4 floats or 8 half / bfloat16 values, which is
// also the x of the key-cache layout [num_blocks, num_kv_heads, head_size / x, block_size, x].
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/util/Exception.h>
#include <c10/core/ScalarType.h>

namespace vllm_lite {
namespace cuda {

// Elements of T in one 16-byte chunk.
template <typename T>
inline constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16-byte load through the read-only path; p must be 16-byte aligned.
__device__ __forceinline__ uint4 load_chunk(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint4 zero_chunk() { return make_uint4(0u, 0u, 0u, 0u); }

// Unpacks one 16-byte chunk into kChunkElems<T> floats (element 0 = lowest address).
template <typename T>
__device__ __forceinline__ void chunk_to_float(const uint4& c, float* out);

template <>
__device__ __forceinline__ void chunk_to_float<float>(const uint4& c, float* out) {
  out[0] = __uint_as_float(c.x);
  out[1] = __uint_as_float(c.y);
  out[2] = __uint_as_float(c.z);
  out[3] = __uint_as_float(c.w);
}

template <>
__device__ __forceinline__ void chunk_to_float<__half>(const uint4& c, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], sizeof(h));
    const float2 f = __half22float2(h);  // .x is the low half (lower address)
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void chunk_to_float<__nv_bfloat16>(const uint4& c, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bfloat16 -> float is exact: the high 16 bits
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

}  // namespace cuda
}  // namespace vllm_lite

// Runs the lambda-body __VA_ARGS__ with `scalar_t` bound to the CUDA-native element type
// of TYPE (float, half or bfloat16); any other dtype fails with NAME in the message.
#define VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                          \
  [&] {                                                                               \
    switch (TYPE) {                                                                   \
      case c10::ScalarType::Float: {                                                  \
        using scalar_t = float;                                                       \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case c10::ScalarType::Half: {                                                   \
        using scalar_t = __half;                                                      \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case c10::ScalarType::BFloat16: {                                               \
        using scalar_t = __nv_bfloat16;                                               \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      default:                                                                        \
        TORCH_CHECK(false, NAME, ": dtype ", TYPE,                                    \
                    " is not supported; use float32, float16 or bfloat16");          \
    }                                                                                 \
  }()
