// Host-side interface between the paged-attention entry points (paged_attention_v1.cu,
// paged_attention_v2.cu) and the one translation unit that instantiates the attention
// kernel templates (paged_attention_v1.cu), so each template is compiled once.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace attn {

// The CUDA kernels are specialized for these block sizes.
inline void check_cuda_block_size(int64_t block_size) {
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32,
              "paged_attention: block_size ", block_size,
              " is not supported on CUDA; use 8, 16 or 32");
}

// Launches paged_attention_kernel on `stream` (the caller has validated the arguments and
// set the device). v1: exp_sums == max_logits == nullptr, out = the output, one partition
// per sequence. v2: out = tmp_out, num_partitions = P of the scratch, grid_partitions <= P
// partitions of 512 tokens are launched. Sequence lengths are clamped to max_tokens.
void launch_paged_attention(const PagedAttentionDims& d, void* out, float* exp_sums,
                            float* max_logits, int64_t num_partitions, int64_t grid_partitions,
                            int64_t max_tokens, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens,
                            const std::optional<at::Tensor>& alibi_slopes, double k_scale,
                            double v_scale, cudaStream_t stream);

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
