// The launchers of the CUDA element-wise kernels (elementwise.cu), called by the
// torch-facing code (elementwise_ops.cpp) with validated raw pointers and sizes (see
// launch_types.h). No torch and no device code: the host compiler reads this header.
// Layouts, grids and limits: elementwise_kernels.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/launch_types.h"

namespace vllm_lite {
namespace cuda {
namespace ew {

cudaError_t launch_rms_norm(FloatType dtype, void* out, const void* input, const void* weight,
                            int64_t rows, int64_t row_stride, int64_t hidden, float epsilon,
                            cudaStream_t stream);

cudaError_t launch_fused_add_rms_norm(FloatType dtype, void* input, void* residual,
                                      const void* weight, int64_t rows, int64_t hidden,
                                      float epsilon, cudaStream_t stream);

// input rows [gate d | up d], row_stride elements apart; out [rows, d].
cudaError_t launch_silu_and_mul(FloatType dtype, void* out, const void* input, int64_t rows,
                                int64_t row_stride, int64_t d, cudaStream_t stream);

struct RotaryLaunch {
  FloatType dtype;    // query / key
  bool float_table;   // cos_sin_cache is float32 (else dtype)
  bool is_neox;
  const int64_t* positions;
  void* query;
  void* key;
  const void* cos_sin_cache;
  int64_t num_tokens;
  int64_t q_stride;
  int64_t k_stride;
  int64_t max_position;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t rot_dim;
};
cudaError_t launch_rotary_embedding(const RotaryLaunch& l, cudaStream_t stream);

}  // namespace ew
}  // namespace cuda
}  // namespace vllm_lite
