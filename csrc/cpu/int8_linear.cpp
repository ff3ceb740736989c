// int8_linear on the CPU: int8 weight-only linear (per-output-channel scales), the GEMM of
// quantization="int8". Decode-sized inputs (<= kInt8KernelMaxRows rows) run the block
// kernel of int8_linear_kernel.h, the AVX2 build where the CPU ISA switch (cpu_isa.h) picks
// a non-generic build, else the generic one; tasks of kInt8ChannelsPerTask output channels
// run on torch's intra-op threads. Larger inputs (prefills) dequantize the weight once and
// use at::linear. Only a CPU kernel exists: on CUDA the Python layer uses torch's
// _weight_int8pack_mm.
#include <memory>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_isa.h"
#include "cpu/int8_linear_params.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

Int8LinearBlockFn select_kernel() {
  // Follows the attention kernel's ISA choice (VLLM_LITE_CPU_ISA / set_cpu_isa), so one
  // switch selects every CPU build; every x86 build but "generic" implies AVX2 + FMA.
  const Int8LinearBlockFn avx2 = int8_linear_avx2();
  if (avx2 != nullptr && cpu_isa() != "generic") return avx2;
  return int8_linear_generic();
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  const int64_t N = check_int8_linear(x, qweight, scales, bias);
  TORCH_CHECK(x.device().is_cpu(), "int8_linear: x must be on the CPU, got ", x.device());
  const int64_t K = qweight.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  if (M > kInt8KernelMaxRows) {
    const at::Tensor w = qweight.to(at::kFloat).mul_(scales.unsqueeze(1));
    return at::linear(x2, w, bias).reshape(out_shape);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape);
  Int8LinearArgs a{x2.data_ptr<float>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                   M, K, N, x2.stride(0)};
  const Int8LinearBlockFn fn = select_kernel();
  const int64_t tasks = (N + kInt8ChannelsPerTask - 1) / kInt8ChannelsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wbuf(static_cast<size_t>(kInt8RowsPerPass * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kInt8ChannelsPerTask;
      fn(a, n0, std::min(N, n0 + kInt8ChannelsPerTask), wbuf.data());
    }
  });
  return y.reshape(out_shape);
}

}  // namespace vllm_lite::cpu
