// pack_linear_weight / packed_linear on the CPU: the float32 and bfloat16 GEMMs of
// models.llama.Linear on CPUs with AVX-512 (packed_linear_avx512.cpp, float32),
// AVX512_BF16 (packed_linear_avx512bf16.cpp, bfloat16) and AVX2 + FMA
// (packed_linear_avx2.cpp, both). Panels of output columns run on
// torch's intra-op threads, each a contiguous range so a thread can prefetch its next
// panel. Where the selected CPU build (VLLM_LITE_CPU_ISA / set_cpu_isa) has no kernel for
// the dtype, the same math runs through at::linear on the unpacked weight, so the op is
// correct wherever it is called. packed_quant_linear runs int8_linear's and int4_linear's
// packed weights on the same kernels, a panel dequantized at a time (packed_dequant.h).
#include <ATen/Parallel.h>

#include "cpu/cpu_isa.h"
#include "cpu/packed_linear_params.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

// The selected build's kernel for dtype (cpu_isa.h): bfloat16 on "amxbf16" (amx, AMX
// tiles) and "avx512bf16", float32 on every build with AVX-512; on the others with AVX2
// (avx2_bf16 / avx2_f32: packed_linear_avx2.cpp) both, where given; nullptr elsewhere.
template <typename Fn>
Fn select_for(at::ScalarType dtype, Fn amx, Fn bf16, Fn f32, Fn avx2_bf16, Fn avx2_f32) {
  if (dtype == at::kBFloat16) {
    if (cpu_isa_includes("amxbf16")) return amx;
    if (cpu_isa_includes("avx512bf16")) return bf16;
  } else if (cpu_isa_includes("avx512")) {
    return f32;
  }
  if (!cpu_isa_includes("avx2")) return nullptr;
  return dtype == at::kBFloat16 ? avx2_bf16 : avx2_f32;
}

PackedLinearFn selected_kernel(at::ScalarType dtype) {
  return select_for(dtype, packed_linear_bf16_amx(), packed_linear_bf16_avx512bf16(),
                    packed_linear_f32_avx512(), packed_linear_bf16_avx2(),
                    packed_linear_f32_avx2());
}

// The quantized entry points: float32 on AVX2 too (bfloat16 x runs it on a float32 copy);
// the generic build keeps int8 / int4 weights in their row layout (int8_linear.cpp).
PackedQuantLinearFn selected_quant_kernel(at::ScalarType dtype) {
  return select_for<PackedQuantLinearFn>(
      dtype, packed_quant_linear_bf16_amx(), packed_quant_linear_bf16_avx512bf16(),
      packed_quant_linear_f32_avx512(), nullptr, packed_quant_linear_f32_avx2());
}

}  // namespace

bool packed_linear_kernel_selected(at::ScalarType dtype) { return selected_kernel(dtype) != nullptr; }

bool packed_quant_linear_kernel_selected() {
  return selected_quant_kernel(at::kFloat) != nullptr;
}

at::Tensor packed_quant_linear(const at::Tensor& x2, const PackedQuantWeight& qw, int64_t N,
                               const float* scale, const std::optional<at::Tensor>& bias) {
  const PackedQuantLinearFn fn = selected_quant_kernel(x2.scalar_type());
  if (fn == nullptr) return {};
  at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  // The bf16 layout pairs k: an odd K gets one zero column of x (its weights dequantize to
  // zero), rather than reading past each row.
  if (x2.scalar_type() == at::kBFloat16 && qw.K % 2 == 1) xc = at::constant_pad_nd(xc, {0, 1});
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x2.options());
  if (M == 0 || N == 0) return y;
  const PackedLinearArgs a{xc.data_ptr(), nullptr, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                           y.data_ptr(), M, xc.size(1), N, xc.stride(0), scale};
  const int64_t panels = (N + kPackedPanelCols - 1) / kPackedPanelCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { fn(a, qw, p0, p1); });
  return y;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_pack_linear_weight(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPackedPanelCols - 1) / kPackedPanelCols;
  at::Tensor padded = weight;
  if (panels * kPackedPanelCols != N) {
    padded = at::zeros({panels * kPackedPanelCols, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
  }
  if (weight.scalar_type() == at::kBFloat16) {
    // [panels, cols, K / 2, 2] -> [panels, K / 2, cols, 2]
    return padded.reshape({panels, kPackedPanelCols, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  // [panels, cols, K] -> [panels, K, cols]: float32, and the int8 / int4 bytes of
  // int8_linear's and int4_linear's qweight (K bytes or K / 2) the same way
  return padded.reshape({panels, kPackedPanelCols, K}).permute({0, 2, 1}).contiguous();
}

at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t N) {
  // [panels, rows, cols(, 2)] -> [panels, cols, rows(, 2)] -> [panels * cols, K]
  const at::Tensor t = packed.dim() == 4 ? packed.permute({0, 2, 1, 3}) : packed.permute({0, 2, 1});
  const int64_t K = packed.dim() == 4 ? 2 * packed.size(1) : packed.size(1);
  return t.reshape({packed.size(0) * kPackedPanelCols, K}).narrow(0, 0, N).contiguous();
}

namespace {

// y [..., N] = x W^T + bias through the selected kernel (N: out_features, or the
// intermediate size of a gated weight: then silu(gate) * up); an undefined tensor where
// the kernel is not selected for x's dtype.
at::Tensor run_packed(const at::Tensor& x, const at::Tensor& packed_weight,
                      const std::optional<at::Tensor>& bias, int64_t N, bool gated) {
  const PackedLinearFn fn = selected_kernel(x.scalar_type());
  if (fn == nullptr) return {};
  const int64_t K = x.size(-1), panels = packed_weight.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K});
  const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  PackedLinearArgs a{xc.data_ptr(), packed_weight.data_ptr(),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr(),
                     M, K, N, xc.stride(0)};
  a.gated = gated;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { fn(a, p0, p1); });
  return y.reshape(out_shape);
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_packed_linear(x, packed_weight, bias, out_features, kPackedPanelCols);
  at::Tensor y = run_packed(x, packed_weight, bias, out_features, /*gated=*/false);
  if (y.defined()) return y;
  const at::Tensor w = unpack_linear_weight(packed_weight, out_features).to(at::kFloat);
  return at::linear(x.to(at::kFloat), w, bias).to(x.scalar_type());
}

at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                               const std::optional<at::Tensor>& bias,
                               int64_t intermediate_size) {
  check_packed_linear(x, packed_weight, bias, intermediate_size, kPackedPanelCols, /*gated=*/true);
  at::Tensor y = run_packed(x, packed_weight, bias, intermediate_size, /*gated=*/true);
  if (y.defined()) return y;
  // No kernel for x's dtype: packed_linear's math on the unpacked weight, its [gate | up]
  // columns put back in order, then silu_and_mul (so the same bits as the unfused ops).
  const int64_t panels = packed_weight.size(0);
  const at::Tensor w =
      unpack_linear_weight(packed_weight, panels * kPackedPanelCols).to(at::kFloat);
  const at::Tensor both = at::linear(x.reshape({-1, x.size(-1)}).to(at::kFloat), w, bias)
                              .to(x.scalar_type()).reshape({-1, panels, 2, kGatedPanelCols});
  const auto half = [&](int64_t h) {
    return both.select(2, h).reshape({-1, panels * kGatedPanelCols})
        .narrow(1, 0, intermediate_size);
  };
  const at::Tensor gate_up = at::cat({half(0), half(1)}, 1);
  at::Tensor out = at::empty({gate_up.size(0), intermediate_size}, x.options());
  silu_and_mul(out, gate_up);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = intermediate_size;
  return out.reshape(out_shape);
}

}  // namespace vllm_lite::cpu
