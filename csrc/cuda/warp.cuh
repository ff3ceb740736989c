// Warp-wide reductions over the 32 lanes of a full warp (every lane must call them; each
// gets the result), shared by the attention, element-wise and MoE kernels.
#pragma once

namespace vllm_lite {
namespace cuda {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

}  // namespace cuda
}  // namespace vllm_lite
