// CUDA fused_moe, the launch: the five kernels of fused_moe_kernels.cuh on one stream, with
// no host round trip (the grids depend on T, E, k, H and I only: the tensor-core GEMMs'
// on the most tiles P rows can need, the sort kernel writing how many there are). No
// torch header (see launch_types.h): the argument checks and the scratch are
// fused_moe_ops.cpp's.
#include <type_traits>

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
        <<<static_cast<unsigned>(ceil_div(T, kMoeRouteTokens)), kMoeThreads, 0, stream>>>(
            static_cast<const logits_t*>(a.router_logits), T, E, k, a.renormalize, a.topk_w,
            a.topk_id);
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  moe_sort_kernel<<<1, kMoeSortThreads, 0, stream>>>(a.topk_id, P, E, a.sorted_pair,
                                                     a.row_of_pair, a.tiles);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const bool tensor_cores = moe_path(a.cc, a.dtype != FloatType::kFloat32, H, I, a.hidden,
                                     a.w13, a.w2) == MoePath::kTensorCore;
  dispatch_float_type(a.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(a.hidden);
    const auto* w13 = static_cast<const scalar_t*>(a.w13);
    const auto* w2 = static_cast<const scalar_t*>(a.w2);
    auto* act = static_cast<scalar_t*>(a.act);
    auto* y = static_cast<scalar_t*>(a.ys);
    bool gemms_done = false;
    if constexpr (!std::is_same_v<scalar_t, float>) {  // (moe_path: 16-bit dtypes only)
      if (tensor_cores) {
        const auto tiles = static_cast<unsigned>(moe_tc_max_tiles(P, E));
        const auto cols = [](int n) { return static_cast<unsigned>(ceil_div(n, kMoeTcCols)); };
        moe_tc_gemm_kernel<scalar_t, true>
            <<<dim3(tiles, cols(I)), kMoeTcWarps * 32, 0, stream>>>(x, w13, a.tiles,
                                                                    a.sorted_pair, k, H, I, act);
        err = cudaGetLastError();
        if (err != cudaSuccess) return;
        moe_tc_gemm_kernel<scalar_t, false>
            <<<dim3(tiles, cols(H)), kMoeTcWarps * 32, 0, stream>>>(act, w2, a.tiles,
                                                                    a.sorted_pair, k, I, H, y);
        err = cudaGetLastError();
        if (err != cudaSuccess) return;
        gemms_done = true;
      }
    }
    if (!gemms_done) {
      const dim3 up_grid(static_cast<unsigned>(P),
                         static_cast<unsigned>(ceil_div(I, kMoeThreads)));
      moe_gate_up_kernel<scalar_t><<<up_grid, kMoeThreads, 0, stream>>>(
          x, w13, a.sorted_pair, a.topk_id, k, H, I, act);
      err = cudaGetLastError();
      if (err != cudaSuccess) return;
      moe_down_kernel<scalar_t>
          <<<dim3(static_cast<unsigned>(P), static_cast<unsigned>(ceil_div(H, kMoeThreads))),
             kMoeThreads, 0, stream>>>(act, w2, a.sorted_pair, a.topk_id, H, I, y);
      err = cudaGetLastError();
      if (err != cudaSuccess) return;
    }
    const unsigned h_blocks = static_cast<unsigned>(ceil_div(H, kMoeThreads));
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
