// The launcher of varlen_paged_attention's CUDA kernels (varlen_attention.cu), called by
// the torch-facing code (attention_ops.cpp) with validated raw pointers and sizes (see
// launch_types.h). No torch and no device code: the host compiler reads this header. The
// kernels' designs, grids and limits: varlen_attention_kernels.cuh and
// varlen_attention_tc_kernels.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/launch_types.h"

namespace vllm_lite {
namespace cuda {
namespace varlen {

struct VarlenLaunchArgs {
  FloatType dtype;  // query / out (and the cache, when cache_dtype is kAuto)
  KvCacheDType cache_dtype;
  int cc;  // the device's compute capability, major * 10 + minor (picks the kernel)
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* alibi_slopes;  // or nullptr
  int64_t num_seqs;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
  int64_t q_stride_seq;
  int64_t q_stride_head;
  int64_t max_query_len;
  double scale;
  double k_scale;
  double v_scale;
  bool flash_layout;
};

// Plans and launches the kernel on `stream`; returns the launch's error. Throws (c10::Error)
// when this build has no kernel for the case or the grid is too large for one launch.
cudaError_t launch_varlen_paged_attention(const VarlenLaunchArgs& a, cudaStream_t stream);

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
