// Warp-wide reductions and scans over the 32 lanes of a full warp (every lane must call
// them), shared by the attention, element-wise and MoE kernels.
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

// Inclusive prefix sum over the lanes (lane l gets the sum of lanes 0..l), in a 1-D block.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

}  // namespace cuda
}  // namespace vllm_lite
