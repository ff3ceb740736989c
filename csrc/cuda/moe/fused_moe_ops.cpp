// The torch side of CUDA fused_moe (ops.h; layers/moe.py states the math): the shared
// argument checks (validate.h's check_fused_moe, without the CPU's packed weights), the
// CUDA-only ones, the output and the kernels' scratch from torch's caching allocator, then
// the launcher (fused_moe.cu) on the current stream.
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/host_utils.h"
#include "cuda/moe/fused_moe_launch.h"
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
  moe::MoeLaunchArgs a{};
  a.dtype = to_float_type(hidden.scalar_type(), "fused_moe");
  a.logits_dtype = to_float_type(router_logits.scalar_type(), "fused_moe");
  at::Tensor out = at::empty({d.tokens, d.hidden}, hidden.options());
  if (d.tokens == 0) return out;
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  const auto i32 = hidden.options().dtype(at::kInt);
  at::Tensor topk_w = at::empty({pairs}, hidden.options().dtype(at::kFloat));
  at::Tensor topk_id = at::empty({pairs}, i32);
  at::Tensor sorted_pair = at::empty({pairs}, i32);
  at::Tensor row_of_pair = at::empty({pairs}, i32);
  at::Tensor tiles = at::empty({moe::moe_tile_table_ints(pairs, d.experts)}, i32);
  at::Tensor act = at::empty({pairs, d.intermediate}, hidden.options());
  at::Tensor ys = at::empty({pairs, d.hidden}, hidden.options());
  a.hidden = hidden.data_ptr();
  a.router_logits = router_logits.data_ptr();
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.out = out.data_ptr();
  a.topk_w = topk_w.data_ptr<float>();
  a.topk_id = topk_id.data_ptr<int32_t>();
  a.sorted_pair = sorted_pair.data_ptr<int32_t>();
  a.row_of_pair = row_of_pair.data_ptr<int32_t>();
  a.act = act.data_ptr();
  a.ys = ys.data_ptr();
  a.tiles = tiles.data_ptr<int32_t>();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  a.cc = props->major * 10 + props->minor;
  a.tokens = static_cast<int>(d.tokens);
  a.experts = static_cast<int>(d.experts);
  a.top_k = static_cast<int>(d.top_k);
  a.hidden_size = static_cast<int>(d.hidden);
  a.intermediate = static_cast<int>(d.intermediate);
  a.renormalize = renormalize;
  C10_CUDA_CHECK(moe::launch_fused_moe(a, at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace cuda
}  // namespace vllm_lite
