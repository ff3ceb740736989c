// paged_attention_v1 on CUDA, and PagedAttentionCall (attention_launch.h): the prologue
// and the attention kernel's launch that v1 and v2 share (SIMT or tensor-core kernel, as
// plan_decode_launch / attention_path.h choose; the kernels' instances are
// compiled in the files csrc/cuda/generate_kernels.py writes, and found here through its
// table; see attention_kernels.cuh for the design). v1 runs
// one CTA per (sequence, kv head[, head group]) over the whole sequence with an online
// softmax in 512-token chunks, so it has no sequence-length limit and needs no scratch.
// Caches in the query dtype or fp8 (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2"; the
// kernels are instantiated per (query dtype, cache element)).
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
namespace attn {

PagedAttentionCall::PagedAttentionCall(
    const char* op, const at::Tensor& out, const at::Tensor* exp_sums,
    const at::Tensor* max_logits, const at::Tensor* tmp_out, const at::Tensor& query,
    const at::Tensor& key_cache, const at::Tensor& value_cache, int64_t num_kv_heads,
    double scale, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    int64_t block_size, int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
    const std::string& kv_cache_dtype, double k_scale, double v_scale)
    : query_(query),
      key_cache_(key_cache),
      value_cache_(value_cache),
      block_tables_(block_tables),
      seq_lens_(seq_lens),
      alibi_slopes_(alibi_slopes),
      scale_(scale),
      k_scale_(k_scale),
      v_scale_(v_scale),
      d_(check_paged_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables,
                               seq_lens, block_size, max_seq_len, alibi_slopes,
                               kv_cache_dtype, k_scale, v_scale)),
      num_partitions_(exp_sums == nullptr
                          ? 1
                          : check_paged_attention_v2_scratch(d_, out, *exp_sums, *max_logits,
                                                             *tmp_out, max_seq_len)) {
  TORCH_CHECK(query.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got query on ",
              query.device());
  check_cuda_block_size(block_size);
  TORCH_CHECK(!d_.flash_layout || d_.head_size % d_.x == 0, op, ": head_size ", d_.head_size,
              " must be a multiple of ", d_.x, " for a flash-layout cache of 16-byte chunks "
              "on CUDA (kv_cache_dtype '", kv_cache_dtype, "')");
  device_guard_.set_device(query.device());
  stream_ = at::cuda::getCurrentCUDAStream();
  if (should_check_values(stream_)) {
    check_paged_attention_values(d_, block_tables, seq_lens, max_seq_len);
  }
}

void PagedAttentionCall::launch(void* out, float* exp_sums, float* max_logits,
                                int64_t num_partitions, int64_t grid_partitions,
                                int64_t max_tokens) const {
  const PagedAttentionDims& d = d_;
  if (d.num_seqs == 0 || d.num_heads == 0 || grid_partitions == 0) return;
  TORCH_CHECK(is_aligned16(key_cache_.data_ptr()) && is_aligned16(value_cache_.data_ptr()),
              "paged_attention: key_cache and value_cache must start at 16-byte aligned "
              "addresses on CUDA");

  const int64_t group = d.num_heads / d.num_kv_heads;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t sms = props->multiProcessorCount;
  const int cc = props->major * 10 + props->minor;
  // The kernel (SIMT or tensor cores: attention_path.h), its CTA split and block.
  DecodeLaunch plan{};
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(query_.scalar_type(), "paged_attention", [&] {
    dispatch_cache_elem<scalar_t>(d.cache_dtype, [&](auto cache_tag) {
      plan = plan_decode_launch<scalar_t, decltype(cache_tag)>(
          cc, d.num_seqs, d.num_kv_heads, group, d.head_size, static_cast<int>(d.block_size),
          grid_partitions, sms);
    });
  });
  const int64_t ctas = plan.split.ctas_per_kv_head;
  const int64_t hpc = plan.split.heads_per_cta;

  const int64_t grid_x = d.num_seqs * d.num_kv_heads * ctas;
  TORCH_CHECK(grid_x <= INT_MAX, "paged_attention: too many sequences for one launch (",
              d.num_seqs, " sequences x ", d.num_kv_heads * ctas, " CTAs each)");
  TORCH_CHECK(grid_partitions <= 65535, "paged_attention: ", grid_partitions,
              " partitions of ", kChunkTokens, " tokens exceed the CUDA grid limit of 65535");

  AttentionParams p{};
  p.out = out;
  p.exp_sums = exp_sums;
  p.max_logits = max_logits;
  p.query = query_.data_ptr();
  p.key_cache = key_cache_.data_ptr();
  p.value_cache = value_cache_.data_ptr();
  p.block_tables = block_tables_.data_ptr<int32_t>();
  p.seq_lens = seq_lens_.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes_.has_value() ? alibi_slopes_->data_ptr<float>() : nullptr;
  p.q_stride_seq = d.q_stride_seq;
  p.q_stride_head = d.q_stride_head;
  p.kv_block_stride = d.num_kv_heads * d.head_size * d.block_size;
  p.flash_layout = d.flash_layout;
  p.kv_token_stride = d.num_kv_heads * d.head_size;
  p.num_blocks = d.num_blocks;
  p.max_tokens = std::max<int64_t>(0, std::min<int64_t>(max_tokens, INT_MAX - kChunkTokens));
  p.num_heads = static_cast<int>(d.num_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.head_size = static_cast<int>(d.head_size);
  p.group_size = static_cast<int>(group);
  p.heads_per_cta = static_cast<int>(hpc);
  p.ctas_per_kv_head = static_cast<int>(ctas);
  p.max_blocks_per_seq = static_cast<int>(d.max_blocks_per_seq);
  p.num_partitions = static_cast<int>(num_partitions);
  p.partition_tokens = exp_sums != nullptr ? kChunkTokens : INT_MAX;
  p.qk_scale = static_cast<float>(scale_ * k_scale_);
  p.v_scale = static_cast<float>(v_scale_);

  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_partitions));
  plan.kernel<<<grid, plan.threads, plan.smem, stream_>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attn

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const attn::PagedAttentionCall call(
      "paged_attention", out, nullptr, nullptr, nullptr, query, key_cache, value_cache,
      num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
      kv_cache_dtype, k_scale, v_scale);
  call.launch(out.data_ptr(), nullptr, nullptr, /*num_partitions=*/1, /*grid_partitions=*/1,
              /*max_tokens=*/call.dims().max_blocks_per_seq * block_size);
}

}  // namespace cuda
}  // namespace vllm_lite
