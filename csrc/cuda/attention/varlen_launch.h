// The launcher of varlen_paged_attention's CUDA kernels (varlen_attention.cu), called by
// the torch-facing code (attention_ops.cpp) with validated raw pointers and sizes (see
// launch_types.h). No torch and no device code: the host compiler reads this header. The
// kernels' designs, grids and limits: varlen_attention_kernels.cuh and
// varlen_attention_tc_kernels.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/attention/attention_launch.h"
#include "cuda/launch_types.h"

namespace vllm_lite {
namespace cuda {
namespace varlen {

// The paged caches as for decode (kv: num_seqs sequences, each with its query rows
// query_start_loc[i] .. query_start_loc[i + 1] of num_tokens).
struct VarlenLaunchArgs {
  attn::PagedKvArgs kv;
  void* out;
  const int32_t* query_start_loc;
  int64_t num_tokens;
  int64_t max_query_len;
};

// Plans and launches the kernel on `stream`; returns the launch's error. Throws (c10::Error)
// when this build has no kernel for the case or the grid is too large for one launch.
cudaError_t launch_varlen_paged_attention(const VarlenLaunchArgs& a, cudaStream_t stream);

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
