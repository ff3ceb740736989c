// CUDA element-wise ops of a decoder layer: rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding (vLLM v0.6 schemas, HF Llama's rounding order; see csrc/ops.h). This
// file holds the kernel launchers (no torch header: see launch_types.h); the kernels, their
// grids and limits are in elementwise_kernels.cuh, the torch ops that check the arguments
// and call these in elementwise_ops.cpp.
#include <type_traits>

#include <cuda_runtime.h>

#include "cuda/dtype.cuh"
#include "cuda/elementwise/elementwise_kernels.cuh"
#include "cuda/elementwise/elementwise_launch.h"

namespace vllm_lite {
namespace cuda {
namespace ew {

cudaError_t launch_rms_norm(FloatType dtype, void* out, const void* input, const void* weight,
                            int64_t rows, int64_t row_stride, int64_t hidden, float epsilon,
                            cudaStream_t stream) {
  dispatch_float_type(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    const NormPlan plan = plan_norm(hidden, row_stride, sizeof(scalar_t), out, input, weight);
    const unsigned grid = static_cast<unsigned>(rows);
    const int h = static_cast<int>(hidden);
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    const auto* w = static_cast<const scalar_t*>(weight);
    if (plan.vec) {
      rms_norm_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(o, x, w, row_stride, h, epsilon);
    } else {
      rms_norm_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(o, x, w, row_stride, h, epsilon);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_fused_add_rms_norm(FloatType dtype, void* input, void* residual,
                                      const void* weight, int64_t rows, int64_t hidden,
                                      float epsilon, cudaStream_t stream) {
  dispatch_float_type(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    // Both are contiguous: rows are hidden apart.
    const NormPlan plan = plan_norm(hidden, hidden, sizeof(scalar_t), input, residual, weight);
    const unsigned grid = static_cast<unsigned>(rows);
    const int h = static_cast<int>(hidden);
    auto* x = static_cast<scalar_t*>(input);
    auto* r = static_cast<scalar_t*>(residual);
    const auto* w = static_cast<const scalar_t*>(weight);
    if (plan.vec) {
      fused_add_rms_norm_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(x, r, w, h, epsilon);
    } else {
      fused_add_rms_norm_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(x, r, w, h, epsilon);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_silu_and_mul(FloatType dtype, void* out, const void* input, int64_t rows,
                                int64_t row_stride, int64_t d, cudaStream_t stream) {
  dispatch_float_type(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    const SiluPlan plan = plan_silu_and_mul(d, row_stride, sizeof(scalar_t), out, input);
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(plan.grid_y));
    const int width = static_cast<int>(d);
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    if (plan.vec) {
      silu_and_mul_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(o, x, row_stride, width);
    } else {
      silu_and_mul_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(o, x, row_stride, width);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_rotary_embedding(const RotaryLaunch& l, cudaStream_t stream) {
  RotaryParams p{};
  p.q_stride = l.q_stride;
  p.k_stride = l.k_stride;
  p.max_position = l.max_position;
  p.num_heads = static_cast<int>(l.num_heads);
  p.num_kv_heads = static_cast<int>(l.num_kv_heads);
  p.head_size = static_cast<int>(l.head_size);
  p.rot_dim = static_cast<int>(l.rot_dim);
  const int threads = rotary_threads(l.num_heads, l.num_kv_heads, l.rot_dim);
  const unsigned grid = static_cast<unsigned>(l.num_tokens);
  dispatch_float_type(l.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    auto* q = static_cast<scalar_t*>(l.query);
    auto* k = static_cast<scalar_t*>(l.key);
    auto launch = [&](auto table_tag) {
      using table_t = decltype(table_tag);
      const auto* cs = static_cast<const table_t*>(l.cos_sin_cache);
      if (l.is_neox) {
        rotary_embedding_kernel<scalar_t, table_t, true>
            <<<grid, threads, 0, stream>>>(l.positions, q, k, cs, p);
      } else {
        rotary_embedding_kernel<scalar_t, table_t, false>
            <<<grid, threads, 0, stream>>>(l.positions, q, k, cs, p);
      }
    };
    // The table is float32 or the query dtype (checked); float32 queries have one kind.
    if (l.float_table || std::is_same_v<scalar_t, float>) {
      launch(float{});
    } else {
      launch(scalar_t{});
    }
  });
  return cudaGetLastError();
}

}  // namespace ew
}  // namespace cuda
}  // namespace vllm_lite
