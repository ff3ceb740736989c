// CUDA fused_moe (ops.h; layers/moe.py states the math): the shared argument checks
// (validate.h's check_fused_moe, without the CPU's packed weights), then the five kernels
// of fused_moe_kernels.cuh on the current stream, with their scratch from torch's caching
// allocator. No host round trip: the grids depend on T, E, k, H and I only.
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_utils.cuh"
#include "cuda/dtype.cuh"
#include "cuda/moe/fused_moe_kernels.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,
                     const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,
                     bool renormalize) {
  const MoeDims d = check_fused_moe(hidden, router_logits, w13, w2, top_k,
                                    /*packed_panel_cols=*/0);
  TORCH_CHECK(hidden.is_cuda(), "fused_moe: the CUDA kernel needs CUDA tensors, got hidden on ",
              hidden.device());
  const int64_t pairs = d.tokens * d.top_k;
  // Rows and features index with int in the kernels (element offsets are 64-bit).
  TORCH_CHECK(pairs <= INT_MAX && d.hidden <= INT_MAX && 2 * d.intermediate <= INT_MAX,
              "fused_moe: ", d.tokens, " tokens x top_k ", d.top_k, " (H ", d.hidden, ", I ",
              d.intermediate, ") are too many for one launch");
  at::Tensor out = at::empty({d.tokens, d.hidden}, hidden.options());
  if (d.tokens == 0) return out;
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto i32 = hidden.options().dtype(at::kInt);
  at::Tensor topk_w = at::empty({pairs}, hidden.options().dtype(at::kFloat));
  at::Tensor topk_id = at::empty({pairs}, i32);
  at::Tensor sorted_pair = at::empty({pairs}, i32);
  at::Tensor row_of_pair = at::empty({pairs}, i32);
  at::Tensor act = at::empty({pairs, d.intermediate}, hidden.options());
  at::Tensor ys = at::empty({pairs, d.hidden}, hidden.options());
  const int T = static_cast<int>(d.tokens), E = static_cast<int>(d.experts);
  const int k = static_cast<int>(d.top_k), H = static_cast<int>(d.hidden);
  const int I = static_cast<int>(d.intermediate), P = static_cast<int>(pairs);
  using namespace moe;
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(router_logits.scalar_type(), "fused_moe", [&] {
    moe_route_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(T, kMoeThreads)), kMoeThreads, 0,
                                 stream>>>(
        static_cast<const scalar_t*>(router_logits.data_ptr()), T, E, k, renormalize,
        topk_w.data_ptr<float>(), topk_id.data_ptr<int>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  moe_sort_kernel<<<1, kMoeSortThreads, 0, stream>>>(topk_id.data_ptr<int>(), P, E,
                                                     sorted_pair.data_ptr<int>(),
                                                     row_of_pair.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(hidden.scalar_type(), "fused_moe", [&] {
    const auto* x = static_cast<const scalar_t*>(hidden.data_ptr());
    auto* a = static_cast<scalar_t*>(act.data_ptr());
    auto* y = static_cast<scalar_t*>(ys.data_ptr());
    const dim3 up_grid(static_cast<unsigned>(P), static_cast<unsigned>(ceil_div(I, kMoeThreads)));
    moe_gate_up_kernel<scalar_t><<<up_grid, kMoeThreads, 0, stream>>>(
        x, static_cast<const scalar_t*>(w13.data_ptr()), sorted_pair.data_ptr<int>(),
        topk_id.data_ptr<int>(), k, H, I, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const unsigned h_blocks = static_cast<unsigned>(ceil_div(H, kMoeThreads));
    moe_down_kernel<scalar_t><<<dim3(static_cast<unsigned>(P), h_blocks), kMoeThreads, 0, stream>>>(
        a, static_cast<const scalar_t*>(w2.data_ptr()), sorted_pair.data_ptr<int>(),
        topk_id.data_ptr<int>(), H, I, y);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moe_combine_kernel<scalar_t><<<dim3(static_cast<unsigned>(T), h_blocks), kMoeThreads, 0, stream>>>(
        y, topk_w.data_ptr<float>(), row_of_pair.data_ptr<int>(), k, H,
        static_cast<scalar_t*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace cuda
}  // namespace vllm_lite
