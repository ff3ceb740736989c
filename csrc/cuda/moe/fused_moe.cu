// CUDA fused_moe, the launch: the five kernels of fused_moe_kernels.cuh on one stream, with
// no host round trip (the grids depend on T, E, k, H and I only). No torch header (see
// launch_types.h): the argument checks and the scratch are fused_moe_ops.cpp's.
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"
#include "cuda/moe/fused_moe_kernels.cuh"
#include "cuda/moe/fused_moe_launch.h"

namespace vllm_lite {
namespace cuda {
namespace moe {

cudaError_t launch_fused_moe(const MoeLaunchArgs& a, cudaStream_t stream) {
  const int T = a.tokens, E = a.experts, k = a.top_k, H = a.hidden_size, I = a.intermediate;
  const int P = T * k;
  dispatch_float_type(a.logits_dtype, [&](auto tag) {
    using logits_t = decltype(tag);
    moe_route_kernel<logits_t>
        <<<static_cast<unsigned>(ceil_div(T, kMoeThreads)), kMoeThreads, 0, stream>>>(
            static_cast<const logits_t*>(a.router_logits), T, E, k, a.renormalize, a.topk_w,
            a.topk_id);
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  moe_sort_kernel<<<1, kMoeSortThreads, 0, stream>>>(a.topk_id, P, E, a.sorted_pair,
                                                     a.row_of_pair);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  dispatch_float_type(a.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(a.hidden);
    auto* act = static_cast<scalar_t*>(a.act);
    auto* y = static_cast<scalar_t*>(a.ys);
    const dim3 up_grid(static_cast<unsigned>(P), static_cast<unsigned>(ceil_div(I, kMoeThreads)));
    moe_gate_up_kernel<scalar_t><<<up_grid, kMoeThreads, 0, stream>>>(
        x, static_cast<const scalar_t*>(a.w13), a.sorted_pair, a.topk_id, k, H, I, act);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    const unsigned h_blocks = static_cast<unsigned>(ceil_div(H, kMoeThreads));
    moe_down_kernel<scalar_t>
        <<<dim3(static_cast<unsigned>(P), h_blocks), kMoeThreads, 0, stream>>>(
            act, static_cast<const scalar_t*>(a.w2), a.sorted_pair, a.topk_id, H, I, y);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    moe_combine_kernel<scalar_t>
        <<<dim3(static_cast<unsigned>(T), h_blocks), kMoeThreads, 0, stream>>>(
            y, a.topk_w, a.row_of_pair, k, H, static_cast<scalar_t*>(a.out));
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace moe
}  // namespace cuda
}  // namespace vllm_lite
