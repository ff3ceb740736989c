// Host-side interface between the paged-attention entry points (paged_attention_v1.cu,
// paged_attention_v2.cu) and the launch of the attention kernel they share, in
// paged_attention_v1.cu (the kernel's instances are compiled in generated files).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
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

// One call of paged_attention_v1 or v2 on CUDA: the prologue both run (every argument
// check, v2's scratch shapes, the CUDA-only checks, the device guard, the stream, the
// content checks) and the launch of the attention kernel they share. It keeps references
// to the caller's tensors, so it lives only for the entry point's call.
class PagedAttentionCall {
 public:
  // op names the entry point in messages. v1 passes nullptr for the three scratch tensors;
  // v2 passes all three.
  PagedAttentionCall(const char* op, const at::Tensor& out, const at::Tensor* exp_sums,
                     const at::Tensor* max_logits, const at::Tensor* tmp_out,
                     const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     int64_t block_size, int64_t max_seq_len,
                     const std::optional<at::Tensor>& alibi_slopes,
                     const std::string& kv_cache_dtype, double k_scale, double v_scale);

  const PagedAttentionDims& dims() const { return d_; }
  // P of v2's scratch; 1 for v1.
  int64_t num_partitions() const { return num_partitions_; }
  cudaStream_t stream() const { return stream_; }

  // Launches paged_attention_kernel on stream(). v1: exp_sums == max_logits == nullptr,
  // out = the output, one partition per sequence. v2: out = tmp_out, num_partitions = P of
  // the scratch, grid_partitions <= P partitions of kPartitionSize tokens are launched.
  // Sequence lengths are clamped to max_tokens.
  void launch(void* out, float* exp_sums, float* max_logits, int64_t num_partitions,
              int64_t grid_partitions, int64_t max_tokens) const;

 private:
  const at::Tensor& query_;
  const at::Tensor& key_cache_;
  const at::Tensor& value_cache_;
  const at::Tensor& block_tables_;
  const at::Tensor& seq_lens_;
  const std::optional<at::Tensor>& alibi_slopes_;
  double scale_, k_scale_, v_scale_;
  PagedAttentionDims d_;
  int64_t num_partitions_;
  c10::cuda::OptionalCUDAGuard device_guard_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
