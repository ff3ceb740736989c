// The launchers of paged attention's CUDA kernels (paged_attention_v1.cu: the attention
// kernel v1 and v2 share; paged_attention_v2.cu: v2's reduce kernel), called by the
// torch-facing code (attention_ops.cpp) with validated raw pointers and sizes (see
// launch_types.h). No torch and no device code: the host compiler reads this header. The
// kernels' design, grids and limits: attention_kernels.cuh, attention_tc_kernels.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/launch_types.h"

namespace vllm_lite {
namespace cuda {
namespace attn {

// The block sizes the CUDA kernels are specialized for.
inline bool cuda_block_size_supported(int64_t block_size) {
  return block_size == 8 || block_size == 16 || block_size == 32;
}

// What every paged-attention launch reads: the query, the paged caches and their metadata,
// as validate.h's PagedAttentionDims describes them (decode and varlen prefill alike).
struct PagedKvArgs {
  FloatType dtype;  // query / out (and the cache, when cache_dtype is kAuto)
  KvCacheDType cache_dtype;
  int cc;  // the device's compute capability, major * 10 + minor (picks the kernel)
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // or nullptr
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
  int64_t q_stride_seq;
  int64_t q_stride_head;
  bool flash_layout;
  double scale;
  double k_scale;
  double v_scale;
};

// One launch of the attention kernel. v1: exp_sums == max_logits == nullptr, out = the
// output, one partition per sequence. v2: out = tmp_out, num_partitions = P of the
// scratch, grid_partitions <= P partitions of kChunkTokens tokens are launched. Sequence
// lengths are clamped to max_tokens.
struct DecodeLaunchArgs {
  PagedKvArgs kv;
  int64_t sms;  // the device's multiprocessors (the CTA split)
  void* out;
  float* exp_sums;
  float* max_logits;
  int64_t num_partitions;
  int64_t grid_partitions;
  int64_t max_tokens;
};

// Plans (SIMT or tensor cores: attention_path.h) and launches on `stream`; returns the
// launch's error. Throws (c10::Error) when this build has no kernel for the case or the
// grid is too large for one launch.
cudaError_t launch_paged_attention(const DecodeLaunchArgs& a, cudaStream_t stream);

// v2's reduce over the partitions of tmp_out into out ([num_seqs, num_heads, head_size]).
// Throws (c10::Error) when the grid is too large for one launch.
cudaError_t launch_paged_attention_v2_reduce(FloatType dtype, void* out, const float* exp_sums,
                                             const float* max_logits, const void* tmp_out,
                                             const int32_t* seq_lens, int64_t max_tokens,
                                             int64_t num_seqs, int64_t num_heads,
                                             int64_t head_size, int64_t num_partitions,
                                             cudaStream_t stream);

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
