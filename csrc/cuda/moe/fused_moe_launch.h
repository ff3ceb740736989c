// The launcher of fused_moe's CUDA kernels (fused_moe.cu), called by the torch-facing code
// (fused_moe_ops.cpp) with validated raw pointers, sizes and the scratch it allocated (see
// launch_types.h). No torch and no device code: the host compiler reads this header. The
// kernels, their grids and rounding: fused_moe_kernels.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/launch_types.h"
#include "cuda/moe/fused_moe_path.h"

namespace vllm_lite {
namespace cuda {
namespace moe {

struct MoeLaunchArgs {
  FloatType dtype;         // hidden, w13, w2, out and the activations
  FloatType logits_dtype;  // router_logits
  const void* hidden;         // [T, H]
  const void* router_logits;  // [T, E]
  const void* w13;            // [E, 2I, H]
  const void* w2;             // [E, H, I]
  void* out;                  // [T, H]
  // Scratch, P = T * top_k rows: routing weights (float) and expert ids, the grouped order
  // and its inverse (int), the activations [P, I] and the experts' outputs [P, H] (dtype).
  float* topk_w;
  int32_t* topk_id;
  int32_t* sorted_pair;
  int32_t* row_of_pair;
  void* act;
  void* ys;
  int32_t* tiles;  // moe_tile_table_ints(P, E) ints (fused_moe_path.h)
  int cc;          // the device's compute capability, major * 10 + minor
  int tokens;
  int experts;
  int top_k;
  int hidden_size;
  int intermediate;
  bool renormalize;
};

// Launches the five kernels in order on `stream`; returns the first launch error.
cudaError_t launch_fused_moe(const MoeLaunchArgs& a, cudaStream_t stream);

}  // namespace moe
}  // namespace cuda
}  // namespace vllm_lite
