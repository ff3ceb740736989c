// The torch side of the CUDA attention ops: the shared argument checks (validate.h, the
// CPU ops' messages), the CUDA-only ones, the device guard and the current stream; the
// launchers they call hold no torch code (see launch_types.h).
//   varlen_paged_attention -> varlen::launch_varlen_paged_attention (varlen_attention.cu)
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/attention/varlen_launch.h"
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
  varlen::VarlenLaunchArgs a{};
  a.dtype = to_float_type(query.scalar_type(), op);
  a.cache_dtype = d.cache_dtype;
  a.cc = props->major * 10 + props->minor;
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  a.num_seqs = d.num_seqs;
  a.num_tokens = d.num_tokens;
  a.num_heads = d.num_heads;
  a.num_kv_heads = d.num_kv_heads;
  a.head_size = d.head_size;
  a.block_size = d.block_size;
  a.num_blocks = d.num_blocks;
  a.max_blocks_per_seq = d.max_blocks_per_seq;
  a.q_stride_seq = d.q_stride_seq;
  a.q_stride_head = d.q_stride_head;
  a.max_query_len = max_query_len;
  a.scale = scale;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.flash_layout = d.flash_layout;
  C10_CUDA_CHECK(varlen::launch_varlen_paged_attention(a, stream));
}

}  // namespace cuda
}  // namespace vllm_lite
