// Replays fused_moe.cu's host code on the emulator, with the kernels of
// csrc/cuda/moe/fused_moe_kernels.cuh; the scratch it takes from torch's allocator is host
// memory here. The argument checks are the Python tests' job (validate.cpp).
#include <climits>
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "emu_runtime.h"  // cuda_shim.h: the CUDA names, before the kernels

// The round-to-nearest intrinsics the element-wise kernels use (the MoE kernels include
// them for silu), as emu_elementwise.cpp defines them.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __frsqrt_rn(float x) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(x))); }

#include "cuda/moe/fused_moe_kernels.cuh"
#include "emu_ops.h"

namespace emu_ops {

namespace moe = vllm_lite::cuda::moe;

template <typename T, typename L>
void fused_moe(const MoeArgs& d) {
  const int64_t pairs = d.tokens * d.top_k;
  if (d.tokens == 0) return;
  if (pairs > INT_MAX || d.hidden > INT_MAX || 2 * d.inter > INT_MAX) {
    throw std::runtime_error("fused_moe: too large for one launch");
  }
  std::vector<float> topk_w(pairs);
  std::vector<int> topk_id(pairs), sorted_pair(pairs), row_of_pair(pairs);
  std::vector<int> tiles(moe::moe_tile_table_ints(pairs, d.experts));
  std::vector<T> act(pairs * d.inter), ys(pairs * d.hidden);
  const int T_ = static_cast<int>(d.tokens), E = static_cast<int>(d.experts);
  const int k = static_cast<int>(d.top_k), H = static_cast<int>(d.hidden);
  const int I = static_cast<int>(d.inter), P = static_cast<int>(pairs);
  const auto blocks = [](int n, int per_block = moe::kMoeThreads) {
    return static_cast<unsigned>(vllm_lite::cuda::ceil_div(n, per_block));
  };
  cuda_emu::launch(&moe::moe_route_kernel<L>, dim3(blocks(T_, moe::kMoeRouteTokens)),
                   dim3(moe::kMoeThreads), 0,
                   "moe_route_kernel", static_cast<const L*>(d.router_logits), T_, E, k,
                   d.renormalize, topk_w.data(), topk_id.data());
  cuda_emu::launch(&moe::moe_sort_kernel, dim3(1), dim3(moe::kMoeSortThreads), 0,
                   "moe_sort_kernel", static_cast<const int*>(topk_id.data()), P, E,
                   sorted_pair.data(), row_of_pair.data(), tiles.data());
  const moe::MoePath path = moe::moe_path(static_cast<int>(d.cc), !std::is_same_v<T, float>, H,
                                          I, d.hidden_states, d.w13, d.w2);
  if (d.path_out != nullptr) *d.path_out = static_cast<int32_t>(path);
  bool gemms_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (path == moe::MoePath::kTensorCore) {
      const auto tiles_n = static_cast<unsigned>(moe::moe_tc_max_tiles(P, E));
      const auto cols = [](int n) {
        return static_cast<unsigned>(vllm_lite::cuda::ceil_div(n, moe::kMoeTcCols));
      };
      cuda_emu::launch(&moe::moe_tc_gemm_kernel<T, true>, dim3(tiles_n, cols(I)),
                       dim3(moe::kMoeTcWarps * 32), 0, "moe_tc_gemm_kernel<gate_up>",
                       static_cast<const T*>(d.hidden_states), static_cast<const T*>(d.w13),
                       static_cast<const int*>(tiles.data()),
                       static_cast<const int*>(sorted_pair.data()), k, H, I, act.data());
      cuda_emu::launch(&moe::moe_tc_gemm_kernel<T, false>, dim3(tiles_n, cols(H)),
                       dim3(moe::kMoeTcWarps * 32), 0, "moe_tc_gemm_kernel<down>",
                       static_cast<const T*>(act.data()), static_cast<const T*>(d.w2),
                       static_cast<const int*>(tiles.data()),
                       static_cast<const int*>(sorted_pair.data()), k, I, H, ys.data());
      gemms_done = true;
    }
  }
  if (!gemms_done) {
    cuda_emu::launch(&moe::moe_gate_up_kernel<T>, dim3(P, blocks(I)), dim3(moe::kMoeThreads), 0,
                     "moe_gate_up_kernel", static_cast<const T*>(d.hidden_states),
                     static_cast<const T*>(d.w13), static_cast<const int*>(sorted_pair.data()),
                     static_cast<const int*>(topk_id.data()), k, H, I, act.data());
    cuda_emu::launch(&moe::moe_down_kernel<T>, dim3(P, blocks(H)), dim3(moe::kMoeThreads), 0,
                     "moe_down_kernel", static_cast<const T*>(act.data()),
                     static_cast<const T*>(d.w2), static_cast<const int*>(sorted_pair.data()),
                     static_cast<const int*>(topk_id.data()), H, I, ys.data());
  }
  cuda_emu::launch(&moe::moe_combine_kernel<T>, dim3(T_, blocks(H)), dim3(moe::kMoeThreads), 0,
                   "moe_combine_kernel", static_cast<const T*>(ys.data()),
                   static_cast<const float*>(topk_w.data()),
                   static_cast<const int*>(row_of_pair.data()), k, H, static_cast<T*>(d.out));
}

template void fused_moe<float, float>(const MoeArgs&);
template void fused_moe<__half, __half>(const MoeArgs&);
template void fused_moe<__half, float>(const MoeArgs&);
template void fused_moe<__nv_bfloat16, __nv_bfloat16>(const MoeArgs&);
template void fused_moe<__nv_bfloat16, float>(const MoeArgs&);

}  // namespace emu_ops
