// CUDA element-wise ops of a decoder layer: rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding (vLLM v0.6 schemas, HF Llama's rounding order; see csrc/ops.h). The
// kernels, their grids and limits: elementwise_kernels.cuh. Each launcher runs the shared
// argument checks (validate.h, the CPU ops' messages), then the CUDA-only ones, and
// launches on the current stream. rotary_embedding's position check reads the tensor (a
// device sync), so it runs only with VLLM_LITE_CHECK_VALUES=1 and never during graph
// capture (should_check_values); without it the kernel clamps positions into the table.
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_utils.cuh"
#include "cuda/dtype.cuh"
#include "cuda/elementwise/elementwise_kernels.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace {

using namespace ew;

void check_on_cuda(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got ", name, " on ",
              t.device());
}

// rows go to grid.x (up to 2^31 - 1); widths index with int in the kernels.
void check_launch_sizes(const char* op, int64_t rows, int64_t width) {
  TORCH_CHECK(rows <= INT_MAX, op, ": ", rows, " rows are too many for one launch");
  TORCH_CHECK(width <= INT_MAX / 2, op, ": rows of ", width, " elements are too wide");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  const RowsDims d = check_rms_norm(out, input, weight, epsilon);
  check_on_cuda("rms_norm", input, "input");
  if (d.rows == 0 || d.hidden == 0) return;
  check_launch_sizes("rms_norm", d.rows, d.hidden);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const NormPlan plan = plan_norm(d.hidden, d.row_stride, input.element_size(), out.data_ptr(),
                                  input.data_ptr(), weight.data_ptr());
  const unsigned grid = static_cast<unsigned>(d.rows);
  const int hidden = static_cast<int>(d.hidden);
  const float eps = static_cast<float>(epsilon);
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    auto* o = static_cast<scalar_t*>(out.data_ptr());
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    if (plan.vec) {
      rms_norm_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(o, x, w, d.row_stride, hidden, eps);
    } else {
      rms_norm_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(o, x, w, d.row_stride, hidden, eps);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  const RowsDims d = check_fused_add_rms_norm(input, residual, weight, epsilon);
  check_on_cuda("fused_add_rms_norm", input, "input");
  if (d.rows == 0 || d.hidden == 0) return;
  check_launch_sizes("fused_add_rms_norm", d.rows, d.hidden);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Both are contiguous: rows are hidden apart.
  const NormPlan plan = plan_norm(d.hidden, d.hidden, input.element_size(), input.data_ptr(),
                                  residual.data_ptr(), weight.data_ptr());
  const unsigned grid = static_cast<unsigned>(d.rows);
  const int hidden = static_cast<int>(d.hidden);
  const float eps = static_cast<float>(epsilon);
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    auto* x = static_cast<scalar_t*>(input.data_ptr());
    auto* r = static_cast<scalar_t*>(residual.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    if (plan.vec) {
      fused_add_rms_norm_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(x, r, w, hidden, eps);
    } else {
      fused_add_rms_norm_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(x, r, w, hidden, eps);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  const RowsDims d = check_silu_and_mul(out, input);
  check_on_cuda("silu_and_mul", input, "input");
  if (d.rows == 0 || d.hidden == 0) return;
  check_launch_sizes("silu_and_mul", d.rows, 2 * d.hidden);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const SiluPlan plan = plan_silu_and_mul(d.hidden, d.row_stride, input.element_size(),
                                          out.data_ptr(), input.data_ptr());
  const dim3 grid(static_cast<unsigned>(d.rows), static_cast<unsigned>(plan.grid_y));
  const int width = static_cast<int>(d.hidden);
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(input.scalar_type(), "silu_and_mul", [&] {
    auto* o = static_cast<scalar_t*>(out.data_ptr());
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    if (plan.vec) {
      silu_and_mul_kernel<scalar_t, true>
          <<<grid, plan.threads, 0, stream>>>(o, x, d.row_stride, width);
    } else {
      silu_and_mul_kernel<scalar_t, false>
          <<<grid, plan.threads, 0, stream>>>(o, x, d.row_stride, width);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const RotaryDims d =
      check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
  check_on_cuda("rotary_embedding", query, "query");
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (should_check_values(stream)) check_rotary_positions(d, positions);
  const int64_t heads = d.num_heads + d.num_kv_heads;
  // An empty table has no row to clamp to (with the value check on, positions already
  // failed above).
  if (d.num_tokens == 0 || heads == 0 || d.max_position == 0) return;
  TORCH_CHECK(d.num_tokens <= INT_MAX, "rotary_embedding: ", d.num_tokens,
              " tokens are too many for one launch");
  TORCH_CHECK(heads * d.head_size <= INT_MAX, "rotary_embedding: ", heads, " heads of ",
              d.head_size, " are too many for one launch");

  RotaryParams p{};
  p.q_stride = d.q_stride;
  p.k_stride = d.k_stride;
  p.max_position = d.max_position;
  p.num_heads = static_cast<int>(d.num_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.head_size = static_cast<int>(d.head_size);
  p.rot_dim = static_cast<int>(d.rot_dim);
  const int threads = rotary_threads(d.num_heads, d.num_kv_heads, d.rot_dim);
  const unsigned grid = static_cast<unsigned>(d.num_tokens);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const bool float_table = cos_sin_cache.scalar_type() == at::kFloat;
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    auto* q = static_cast<scalar_t*>(query.data_ptr());
    auto* k = static_cast<scalar_t*>(key.data_ptr());
    auto launch = [&](auto table_tag) {
      using table_t = decltype(table_tag);
      const auto* cs = static_cast<const table_t*>(cos_sin_cache.data_ptr());
      if (is_neox) {
        rotary_embedding_kernel<scalar_t, table_t, true>
            <<<grid, threads, 0, stream>>>(pos, q, k, cs, p);
      } else {
        rotary_embedding_kernel<scalar_t, table_t, false>
            <<<grid, threads, 0, stream>>>(pos, q, k, cs, p);
      }
    };
    // The table is float32 or the query dtype (checked); float32 queries have one kind.
    if (float_table || std::is_same_v<scalar_t, float>) {
      launch(float{});
    } else {
      launch(scalar_t{});
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace vllm_lite
