// varlen_paged_attention on CUDA, the launch: the plan (grid, block, shared memory) and
// the launch of varlen_paged_attention_kernel or, on sm_80 and newer where
// attention_path.h says so, of varlen_paged_attention_tc_kernel (see
// varlen_attention_kernels.cuh and varlen_attention_tc_kernels.cuh for the designs). One
// CTA per (query tile, sequence, kv head[, head chunk]); the grid comes from max_query_len
// and the kernel finds its rows through query_start_loc on the device, so the launch needs
// no host copy of the metadata (CUDA-graph safe). Caches in the query dtype or fp8. No
// torch header (see launch_types.h): the argument checks are in attention_ops.cpp.
#include <climits>

#include <cuda_runtime.h>

#include "cuda/attention/varlen_attention_kernels.cuh"
#include "cuda/attention/varlen_launch.h"
#include "cuda/dtype.cuh"

namespace vllm_lite {
namespace cuda {
namespace varlen {

cudaError_t launch_varlen_paged_attention(const VarlenLaunchArgs& a, cudaStream_t stream) {
  constexpr const char* op = "varlen_paged_attention";
  // The kernel (SIMT or tensor cores: attention_path.h) and its grid.
  VarlenLaunch launch{};
  dispatch_float_type(a.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_elem<scalar_t>(a.cache_dtype, [&](auto cache_tag) {
      launch = plan_varlen_launch<scalar_t, decltype(cache_tag)>(
          a.cc, a.num_seqs, a.num_kv_heads, a.num_heads / a.num_kv_heads, a.head_size,
          a.max_query_len);
    });
  });
  const VarlenPlan& plan = launch.plan;
  TORCH_CHECK(plan.grid_x <= INT_MAX, op, ": too many CTAs for one launch (",
              plan.query_tiles, " query tiles of ", plan.query_tile, " tokens x ", a.num_seqs,
              " sequences x ", a.num_kv_heads * plan.head_chunks, " head groups)");
  const VarlenParams p = make_varlen_params(
      plan, a.num_seqs, a.num_tokens, a.num_heads, a.num_kv_heads, a.head_size, a.block_size,
      a.num_blocks, a.max_blocks_per_seq, a.q_stride_seq, a.q_stride_head, a.scale, a.k_scale,
      a.v_scale, a.out, a.query, a.key_cache, a.value_cache, a.block_tables, a.seq_lens,
      a.query_start_loc, a.alibi_slopes, a.flash_layout);
  launch.kernel<<<static_cast<unsigned>(plan.grid_x), launch.threads, plan.smem_bytes, stream>>>(
      p);
  return cudaGetLastError();
}

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
