// paged_attention_v2 on CUDA: the attention kernel (launched by paged_attention_v1.cu's
// PagedAttentionCall) runs one CTA per (sequence, kv head[, head group], 512-token
// partition) and writes each partition's max logit, exp sum and normalized output to the
// caller's scratch; the reduce kernel here combines the partitions into out. See
// attention_kernels.cuh.
#include <algorithm>
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/attention/attention_kernels.cuh"
#include "cuda/attention/attention_launch.h"
#include "cuda/cuda_utils.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const attn::PagedAttentionCall call(
      "paged_attention_v2", out, &exp_sums, &max_logits, &tmp_out, query, key_cache,
      value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
      alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  const PagedAttentionDims& d = call.dims();
  const int64_t num_partitions = call.num_partitions();
  if (out.numel() == 0) return;
  TORCH_CHECK(num_partitions <= INT_MAX, "paged_attention_v2: ", num_partitions,
              " partitions are too many");

  // Only the partitions max_seq_len can reach are launched; lengths are clamped to them
  // (and to the block table) in both kernels, so unvalidated lengths stay in bounds.
  const int64_t grid_partitions =
      std::min(num_partitions, ceil_div(max_seq_len, attn::kChunkTokens));
  const int64_t max_tokens = std::min(d.max_blocks_per_seq * block_size,
                                      grid_partitions * attn::kChunkTokens);
  call.launch(tmp_out.data_ptr(), exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(),
              num_partitions, grid_partitions, max_tokens);

  const int64_t grid_x = d.num_seqs * d.num_heads;
  TORCH_CHECK(grid_x <= INT_MAX, "paged_attention_v2: too many (sequence, head) pairs (",
              grid_x, ") for one launch");
  attn::ReduceParams rp{};
  rp.out = out.data_ptr();
  rp.exp_sums = exp_sums.data_ptr<float>();
  rp.max_logits = max_logits.data_ptr<float>();
  rp.tmp_out = tmp_out.data_ptr();
  rp.seq_lens = seq_lens.data_ptr<int32_t>();
  rp.max_tokens = max_tokens;
  rp.num_heads = static_cast<int>(d.num_heads);
  rp.head_size = static_cast<int>(d.head_size);
  rp.num_partitions = static_cast<int>(num_partitions);
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_v2", [&] {
    attn::paged_attention_v2_reduce_kernel<scalar_t>
        <<<static_cast<unsigned>(grid_x), attn::kThreads, 0, call.stream()>>>(rp);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace vllm_lite
