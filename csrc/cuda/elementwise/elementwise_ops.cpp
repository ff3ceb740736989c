// The torch side of the CUDA element-wise ops (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding): each runs the shared argument checks (validate.h, the CPU ops'
// messages), then the CUDA-only ones, and calls its launcher (elementwise.cu) on the
// current stream. rotary_embedding's position check reads the tensor (a device sync), so it
// runs only with VLLM_LITE_CHECK_VALUES=1 and never during graph capture
// (should_check_values); without it the kernel clamps positions into the table.
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/host_utils.h"
#include "cuda/elementwise/elementwise_launch.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace {

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
  const FloatType dtype = to_float_type(input.scalar_type(), "rms_norm");
  const c10::cuda::CUDAGuard device_guard(input.device());
  C10_CUDA_CHECK(ew::launch_rms_norm(dtype, out.data_ptr(), input.data_ptr(), weight.data_ptr(),
                                     d.rows, d.row_stride, d.hidden,
                                     static_cast<float>(epsilon),
                                     at::cuda::getCurrentCUDAStream()));
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  const RowsDims d = check_fused_add_rms_norm(input, residual, weight, epsilon);
  check_on_cuda("fused_add_rms_norm", input, "input");
  if (d.rows == 0 || d.hidden == 0) return;
  check_launch_sizes("fused_add_rms_norm", d.rows, d.hidden);
  const FloatType dtype = to_float_type(input.scalar_type(), "fused_add_rms_norm");
  const c10::cuda::CUDAGuard device_guard(input.device());
  C10_CUDA_CHECK(ew::launch_fused_add_rms_norm(
      dtype, input.data_ptr(), residual.data_ptr(), weight.data_ptr(), d.rows, d.hidden,
      static_cast<float>(epsilon), at::cuda::getCurrentCUDAStream()));
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  const RowsDims d = check_silu_and_mul(out, input);
  check_on_cuda("silu_and_mul", input, "input");
  if (d.rows == 0 || d.hidden == 0) return;
  check_launch_sizes("silu_and_mul", d.rows, 2 * d.hidden);
  const FloatType dtype = to_float_type(input.scalar_type(), "silu_and_mul");
  const c10::cuda::CUDAGuard device_guard(input.device());
  C10_CUDA_CHECK(ew::launch_silu_and_mul(dtype, out.data_ptr(), input.data_ptr(), d.rows,
                                         d.row_stride, d.hidden,
                                         at::cuda::getCurrentCUDAStream()));
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

  ew::RotaryLaunch l{};
  l.dtype = to_float_type(query.scalar_type(), "rotary_embedding");
  l.float_table = cos_sin_cache.scalar_type() == at::kFloat;
  l.is_neox = is_neox;
  l.positions = positions.data_ptr<int64_t>();
  l.query = query.data_ptr();
  l.key = key.data_ptr();
  l.cos_sin_cache = cos_sin_cache.data_ptr();
  l.num_tokens = d.num_tokens;
  l.q_stride = d.q_stride;
  l.k_stride = d.k_stride;
  l.max_position = d.max_position;
  l.num_heads = d.num_heads;
  l.num_kv_heads = d.num_kv_heads;
  l.head_size = d.head_size;
  l.rot_dim = d.rot_dim;
  C10_CUDA_CHECK(ew::launch_rotary_embedding(l, stream));
}

}  // namespace cuda
}  // namespace vllm_lite
