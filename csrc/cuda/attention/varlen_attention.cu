// varlen_paged_attention on CUDA: the argument checks, the launch plan and the launch of
// varlen_paged_attention_kernel or, on sm_80 and newer where attention_path.h says so, of
// varlen_paged_attention_tc_kernel (see varlen_attention_kernels.cuh and
// varlen_attention_tc_kernels.cuh for the designs). One CTA
// per (query tile, sequence, kv head[, head chunk]); the grid comes from max_query_len and
// the kernel finds its rows through query_start_loc on the device, so the launch needs no
// host copy of the metadata (CUDA-graph safe). Caches in the query dtype or fp8.
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/attention/varlen_attention_kernels.cuh"
#include "cuda/cuda_utils.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {

void varlen_paged_attention(at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            int64_t block_size, int64_t max_query_len, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  constexpr const char* op = "varlen_paged_attention";
  const PagedAttentionDims d = check_varlen_paged_attention(
      out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, query_start_loc,
      block_size, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  TORCH_CHECK(query.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got query on ",
              query.device());
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, op, ": block_size ",
              block_size, " is not supported on CUDA; use 8, 16 or 32");
  TORCH_CHECK(!d.flash_layout || d.head_size % d.x == 0, op, ": head_size ", d.head_size,
              " must be a multiple of ", d.x, " for a flash-layout cache of 16-byte chunks "
              "on CUDA (kv_cache_dtype '", kv_cache_dtype, "')");
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (should_check_values(stream)) {
    check_varlen_paged_attention_values(d, block_tables, seq_lens, query_start_loc,
                                        max_query_len, max_seq_len);
  }
  if (d.num_tokens == 0 || d.num_heads == 0 || d.num_seqs == 0 || max_query_len == 0) return;
  TORCH_CHECK(is_aligned16(key_cache.data_ptr()) && is_aligned16(value_cache.data_ptr()), op,
              ": key_cache and value_cache must start at 16-byte aligned addresses on CUDA");

  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int cc = props->major * 10 + props->minor;
  // The kernel (SIMT or tensor cores: attention_path.h) and its grid.
  varlen::VarlenLaunch launch{};
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(query.scalar_type(), op, [&] {
    dispatch_cache_elem<scalar_t>(d.cache_dtype, [&](auto cache_tag) {
      launch = varlen::plan_varlen_launch<scalar_t, decltype(cache_tag)>(
          cc, d.num_seqs, d.num_kv_heads, d.num_heads / d.num_kv_heads, d.head_size,
          max_query_len);
    });
  });
  const varlen::VarlenPlan& plan = launch.plan;
  TORCH_CHECK(plan.grid_x <= INT_MAX, op, ": too many CTAs for one launch (",
              plan.query_tiles, " query tiles of ", plan.query_tile, " tokens x ", d.num_seqs,
              " sequences x ", d.num_kv_heads * plan.head_chunks, " head groups)");
  const varlen::VarlenParams p = varlen::make_varlen_params(
      plan, d.num_seqs, d.num_tokens, d.num_heads, d.num_kv_heads, d.head_size, d.block_size,
      d.num_blocks, d.max_blocks_per_seq, d.q_stride_seq, d.q_stride_head, scale, k_scale,
      v_scale, out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
      query_start_loc.data_ptr<int32_t>(),
      alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr, d.flash_layout);
  launch.kernel<<<static_cast<unsigned>(plan.grid_x), launch.threads, plan.smem_bytes, stream>>>(
      p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace vllm_lite
