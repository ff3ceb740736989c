// int8_linear / int4_linear on the CPU: weight-only linear layers, the GEMMs of
// quantization="int8" (per-output-channel scales, or GGUF Q8_0's groups of 32) and "int4" /
// "gguf" / "gptq" / "awq" (groups of 32-128 weights with a scale and a zero).
// - A qweight packed by pack_linear_weight ([panels, K or K / 2, 48]; the layers pack it at
//   load where the selected build has the kernels) runs packed_linear's register tiles
//   (float32: AVX-512 or AVX2; bfloat16: AVX512-BF16, else float32 on a copy of x), each
//   panel of 48 output columns dequantized once per block of rows into a per-thread
//   buffer in the packed float layout (packed_dequant.h, packed_quant_linear in
//   packed_linear.cpp), any number of rows; a decode's few rows (kQuantFusedRows; float32
//   with int8 weights kQuantFusedRowsF32) take the panel's rows dequantized in registers
//   instead, no buffer. The generic build unpacks it per call and runs the paths below.
// - A qweight [N, K] / [N, K / 2]: decode-sized float32 inputs (<= kInt8KernelMaxRows rows)
//   run the block kernels of int8_linear_kernel.h (the AVX2 build where the CPU ISA switch,
//   cpu_isa.h, picks a non-generic build, else the generic one) on tasks of
//   kInt8ChannelsPerTask output channels over torch's intra-op threads; larger float32
//   inputs (prefills) dequantize the weight once and use at::linear. bfloat16 x runs the
//   AVX512-BF16 kernels (int8_linear_avx512bf16.cpp) for any number of rows when that build
//   is selected, else the float32 path on a float32 copy.
// Only CPU kernels exist: on CUDA the Python layer uses torch's _weight_int8pack_mm (int8)
// or dequantizes at load (int4).
#include <memory>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_isa.h"
#include "cpu/int8_linear_params.h"
#include "cpu/packed_linear_params.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

// Follows the attention kernel's ISA choice (VLLM_LITE_CPU_ISA / set_cpu_isa), so one
// switch selects every CPU build; every x86 build but "generic" implies AVX2 + FMA.
template <typename Fn>
Fn select_kernel(Fn avx2, Fn generic) {
  return avx2 != nullptr && cpu_isa_includes("avx2") ? avx2 : generic;
}

// Runs fn(n0, n1, wbuf) over tasks of kInt8ChannelsPerTask output channels in parallel;
// wbuf holds kInt8RowsPerPass rows of `row` elements of type T per thread.
template <typename T = float, typename Block>
void run_channel_tasks(int64_t N, int64_t row, Block&& block) {
  const int64_t tasks = (N + kInt8ChannelsPerTask - 1) / kInt8ChannelsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> wbuf(static_cast<size_t>(kInt8RowsPerPass * row));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kInt8ChannelsPerTask;
      block(n0, std::min(N, n0 + kInt8ChannelsPerTask), wbuf.data());
    }
  });
}

// The packed path for x2 [M, K]: x2's dtype where the selected build has that kernel, else
// bfloat16 on the float32 kernel, rounded once; undefined where neither exists.
at::Tensor run_packed(const at::Tensor& x2, const PackedQuantWeight& qw, int64_t N,
                      const float* scale, const std::optional<at::Tensor>& bias) {
  at::Tensor y = packed_quant_linear(x2, qw, N, scale, bias);
  if (!y.defined() && x2.scalar_type() == at::kBFloat16) {
    y = packed_quant_linear(x2.to(at::kFloat), qw, N, scale, bias);
    if (y.defined()) y = y.to(at::kBFloat16);
  }
  return y;
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  const int64_t N = check_int8_linear(x, qweight, scales, bias, kPackedPanelCols);
  TORCH_CHECK(x.device().is_cpu(), "int8_linear: x must be on the CPU, got ", x.device());
  const int64_t K = qweight.size(1);
  const int64_t group_size = scales.dim() == 2 ? K / scales.size(1) : 0;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  // Rows need only be contiguous within themselves (the kernels take a row stride).
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  if (qweight.dim() == 3) {
    const PackedQuantWeight qw{qweight.data_ptr<int8_t>(),
                               group_size > 0 ? scales.data_ptr<float>() : nullptr, nullptr, K,
                               group_size, false};
    const at::Tensor y =
        run_packed(x2, qw, N, group_size == 0 ? scales.data_ptr<float>() : nullptr, bias);
    if (y.defined()) return y.reshape(out_shape);
    return int8_linear(x, unpack_linear_weight(qweight, N), scales, bias);
  }
  if (x.scalar_type() == at::kBFloat16) {
    const Int8LinearBf16BlockFn bf16 =
        cpu_isa_includes("avx512bf16") ? int8_linear_bf16_avx512bf16() : nullptr;
    if (bf16 == nullptr) {
      // No bf16 dot products in the selected build: the float32 kernel, rounded once.
      return int8_linear(x.to(at::kFloat), qweight, scales, bias).to(at::kBFloat16);
    }
    const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y.reshape(out_shape);
    Int8LinearBf16Args a{reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                         qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                         bias.has_value() ? bias->data_ptr<float>() : nullptr,
                         reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N,
                         xc.stride(0), group_size};
    run_channel_tasks<uint16_t>(N, int8_bf16_padded_k(K), [&](int64_t n0, int64_t n1,
                                                              uint16_t* wbuf) {
      bf16(a, n0, n1, wbuf);
    });
    return y.reshape(out_shape);
  }
  if (M > kInt8KernelMaxRows) {
    const at::Tensor w =
        group_size == 0
            ? qweight.to(at::kFloat).mul_(scales.unsqueeze(1))
            : qweight.to(at::kFloat).view({N, scales.size(1), group_size}).mul_(
                  scales.unsqueeze(-1)).view({N, K});
    return at::linear(x2, w, bias).reshape(out_shape);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape);
  const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  Int8LinearArgs a{xc.data_ptr<float>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                   M, K, N, xc.stride(0), group_size};
  const Int8LinearBlockFn fn = select_kernel(int8_linear_avx2(), int8_linear_generic());
  run_channel_tasks(N, K, [&](int64_t n0, int64_t n1, float* wbuf) { fn(a, n0, n1, wbuf); });
  return y.reshape(out_shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size,
                       const std::optional<at::Tensor>& bias) {
  const int64_t N =
      check_int4_linear(x, qweight, scales, zeros, group_size, bias, kPackedPanelCols);
  TORCH_CHECK(x.device().is_cpu(), "int4_linear: x must be on the CPU, got ", x.device());
  const int64_t K = x.size(-1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  if (qweight.dim() == 3) {
    const PackedQuantWeight qw{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                               zeros.data_ptr<float>(), K, group_size, true};
    const at::Tensor y = run_packed(x2, qw, N, nullptr, bias);
    if (y.defined()) return y.reshape(out_shape);
    return int4_linear(x, unpack_linear_weight(qweight, N), scales, zeros, group_size, bias);
  }
  if (x.scalar_type() == at::kBFloat16) {
    const Int4LinearBf16BlockFn bf16 =
        cpu_isa_includes("avx512bf16") ? int4_linear_bf16_avx512bf16() : nullptr;
    if (bf16 == nullptr) {
      return int4_linear(x.to(at::kFloat), qweight, scales, zeros, group_size, bias)
          .to(at::kBFloat16);
    }
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y.reshape(out_shape);
    Int4LinearBf16Args a{reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()),
                         qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                         zeros.data_ptr<float>(),
                         bias.has_value() ? bias->data_ptr<float>() : nullptr,
                         reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N,
                         x2.stride(0), group_size};
    run_channel_tasks<uint16_t>(N, K, [&](int64_t n0, int64_t n1, uint16_t* wbuf) {
      bf16(a, n0, n1, wbuf);
    });
    return y.reshape(out_shape);
  }
  if (M > kInt8KernelMaxRows) {
    // Prefills: dequantize once, then the float32 GEMM.
    const at::Tensor q = at::stack({qweight.bitwise_and(15), qweight.bitwise_right_shift(4)}, -1)
                             .reshape({N, K / group_size, group_size})
                             .to(at::kFloat);
    const at::Tensor w = q.mul(scales.unsqueeze(-1)).add_(zeros.unsqueeze(-1)).reshape({N, K});
    return at::linear(x2, w, bias).reshape(out_shape);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape);
  Int4LinearArgs a{x2.data_ptr<float>(), qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   zeros.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   y.data_ptr<float>(), M, K, N, x2.stride(0), group_size};
  const Int4LinearBlockFn fn = select_kernel(int4_linear_avx2(), int4_linear_generic());
  run_channel_tasks(N, K, [&](int64_t n0, int64_t n1, float* wbuf) { fn(a, n0, n1, wbuf); });
  return y.reshape(out_shape);
}

}  // namespace vllm_lite::cpu
