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
  const attn::PagedKvArgs& kv = a.kv;
  // The kernel (SIMT or tensor cores: attention_path.h) and its grid.
  VarlenLaunch launch{};
  dispatch_float_type(kv.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_elem<scalar_t>(kv.cache_dtype, [&](auto cache_tag) {
      launch = plan_varlen_launch<scalar_t, decltype(cache_tag)>(
          kv.cc, kv.num_seqs, kv.num_kv_heads, kv.num_heads / kv.num_kv_heads, kv.head_size,
          a.max_query_len);
    });
  });
  const VarlenPlan& plan = launch.plan;
  TORCH_CHECK(plan.grid_x <= INT_MAX, op, ": too many CTAs for one launch (",
              plan.query_tiles, " query tiles of ", plan.query_tile, " tokens x ", kv.num_seqs,
              " sequences x ", kv.num_kv_heads * plan.head_chunks, " head groups)");
  const VarlenParams p = make_varlen_params(
      plan, kv.num_seqs, a.num_tokens, kv.num_heads, kv.num_kv_heads, kv.head_size,
      kv.block_size, kv.num_blocks, kv.max_blocks_per_seq, kv.q_stride_seq, kv.q_stride_head,
      kv.scale, kv.k_scale, kv.v_scale, a.out, kv.query, kv.key_cache, kv.value_cache,
      kv.block_tables, kv.seq_lens, a.query_start_loc, kv.alibi_slopes, kv.flash_layout);
  launch.kernel<<<static_cast<unsigned>(plan.grid_x), launch.threads, plan.smem_bytes, stream>>>(
      p);
  return cudaGetLastError();
}

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
