// pack_bf16_weight / bf16_linear on the CPU: the bfloat16 GEMM of models.llama.Linear on
// CPUs with AVX512_BF16 (bf16_linear_avx512bf16.cpp). Panels of output columns run on
// torch's intra-op threads, each a contiguous range so a thread can prefetch its next
// panel. Another selected CPU build (VLLM_LITE_CPU_ISA / set_cpu_isa) gets the same math
// through at::linear on the unpacked weight, so the op is correct wherever it is called.
#include <ATen/Parallel.h>

#include "cpu/bf16_linear_params.h"
#include "cpu/cpu_isa.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  check_pack_bf16_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kBf16PanelCols - 1) / kBf16PanelCols;
  at::Tensor padded = weight;
  if (panels * kBf16PanelCols != N) {
    padded = at::zeros({panels * kBf16PanelCols, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
  }
  // [panels, cols, K / 2, 2] -> [panels, K / 2, cols, 2]
  return padded.reshape({panels, kBf16PanelCols, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_bf16_linear(x, packed_weight, bias, out_features, kBf16PanelCols);
  const int64_t K = x.size(-1), N = out_features, panels = packed_weight.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const Bf16LinearFn fn = cpu_isa() == "avx512bf16" ? bf16_linear_avx512bf16() : nullptr;
  if (fn == nullptr) {
    const at::Tensor w = packed_weight.permute({0, 2, 1, 3})
                             .reshape({panels * kBf16PanelCols, K})
                             .narrow(0, 0, N)
                             .to(at::kFloat);
    return at::linear(x.to(at::kFloat), w, bias).to(at::kBFloat16);
  }
  const at::Tensor x2 = x.reshape({-1, K});
  const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  const Bf16LinearArgs a{reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(packed_weight.data_ptr<at::BFloat16>()),
                         bias.has_value() ? bias->data_ptr<float>() : nullptr,
                         reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N,
                         xc.stride(0)};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { fn(a, p0, p1); });
  return y.reshape(out_shape);
}

}  // namespace vllm_lite::cpu
