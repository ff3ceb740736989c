// Replays elementwise.cu's host code (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding) on the emulator, with the kernels and launch plans of
// csrc/cuda/elementwise/elementwise_kernels.cuh. The argument checks are the Python tests'
// job (validate.cpp); this mirrors what the launchers do after them.
#include <climits>
#include <cmath>
#include <stdexcept>

#include "emu_runtime.h"  // cuda_shim.h: the CUDA names, before the kernels

// Device intrinsics the element-wise kernels use beyond cuda_shim.h (kept here so the
// shared shim is untouched): IEEE round-to-nearest products and a correctly rounded
// reciprocal square root (x86 float32 math is IEEE and g++ does not contract a * b + c by
// default under -std=c++20, so a plain product is __fmul_rn). __frsqrt_rn: 1 / sqrt in
// double, rounded to float: the correctly rounded result unless 1 / sqrt(x) lies within
// about 2^-52 (relative) of a float32 tie, and one float32 ulp off at worst; the tests of
// the norms allow for a few ulps of float32 anyway (the sum's order is free).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __frsqrt_rn(float x) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(x))); }

#include "cuda/elementwise/elementwise_kernels.cuh"
#include "emu_ops.h"

namespace emu_ops {

namespace ew = vllm_lite::cuda::ew;

namespace {

void check_sizes(const char* op, int64_t rows, int64_t width) {
  if (rows > INT_MAX || width > INT_MAX / 2) {
    throw std::runtime_error(std::string(op) + ": too large for one launch");
  }
}

}  // namespace

template <typename T>
void rms_norm(const RowsArgs& d, void* out, const void* input, const void* weight) {
  if (d.rows == 0 || d.hidden == 0) return;
  check_sizes("rms_norm", d.rows, d.hidden);
  const ew::NormPlan plan = ew::plan_norm(d.hidden, d.row_stride, sizeof(T), out, input, weight);
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(input);
  const auto* w = static_cast<const T*>(weight);
  const dim3 grid(static_cast<unsigned>(d.rows));
  const int hidden = static_cast<int>(d.hidden);
  const float eps = static_cast<float>(d.epsilon);
  if (plan.vec) {
    cuda_emu::launch(&ew::rms_norm_kernel<T, true>, grid, dim3(plan.threads), 0,
                     "rms_norm_kernel<vec>", o, x, w, d.row_stride, hidden, eps);
  } else {
    cuda_emu::launch(&ew::rms_norm_kernel<T, false>, grid, dim3(plan.threads), 0,
                     "rms_norm_kernel", o, x, w, d.row_stride, hidden, eps);
  }
}

template <typename T>
void fused_add_rms_norm(const RowsArgs& d, void* input, void* residual, const void* weight) {
  if (d.rows == 0 || d.hidden == 0) return;
  check_sizes("fused_add_rms_norm", d.rows, d.hidden);
  const ew::NormPlan plan = ew::plan_norm(d.hidden, d.hidden, sizeof(T), input, residual, weight);
  auto* x = static_cast<T*>(input);
  auto* r = static_cast<T*>(residual);
  const auto* w = static_cast<const T*>(weight);
  const dim3 grid(static_cast<unsigned>(d.rows));
  const int hidden = static_cast<int>(d.hidden);
  const float eps = static_cast<float>(d.epsilon);
  if (plan.vec) {
    cuda_emu::launch(&ew::fused_add_rms_norm_kernel<T, true>, grid, dim3(plan.threads), 0,
                     "fused_add_rms_norm_kernel<vec>", x, r, w, hidden, eps);
  } else {
    cuda_emu::launch(&ew::fused_add_rms_norm_kernel<T, false>, grid, dim3(plan.threads), 0,
                     "fused_add_rms_norm_kernel", x, r, w, hidden, eps);
  }
}

template <typename T>
void silu_and_mul(const RowsArgs& d, void* out, const void* input) {
  if (d.rows == 0 || d.hidden == 0) return;
  check_sizes("silu_and_mul", d.rows, 2 * d.hidden);
  const ew::SiluPlan plan = ew::plan_silu_and_mul(d.hidden, d.row_stride, sizeof(T), out, input);
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(input);
  const dim3 grid(static_cast<unsigned>(d.rows), static_cast<unsigned>(plan.grid_y));
  const int width = static_cast<int>(d.hidden);
  if (plan.vec) {
    cuda_emu::launch(&ew::silu_and_mul_kernel<T, true>, grid, dim3(plan.threads), 0,
                     "silu_and_mul_kernel<vec>", o, x, d.row_stride, width);
  } else {
    cuda_emu::launch(&ew::silu_and_mul_kernel<T, false>, grid, dim3(plan.threads), 0,
                     "silu_and_mul_kernel", o, x, d.row_stride, width);
  }
}

template <typename T, typename CT>
void rotary_embedding(const RotaryArgs& d) {
  const int64_t heads = d.num_heads + d.num_kv_heads;
  if (d.num_tokens == 0 || heads == 0 || d.max_position == 0) return;
  if (d.num_tokens > INT_MAX || heads * d.head_size > INT_MAX) {
    throw std::runtime_error("rotary_embedding: too large for one launch");
  }
  ew::RotaryParams p{};
  p.q_stride = d.q_stride;
  p.k_stride = d.k_stride;
  p.max_position = d.max_position;
  p.num_heads = static_cast<int>(d.num_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.head_size = static_cast<int>(d.head_size);
  p.rot_dim = static_cast<int>(d.rot_dim);
  const int threads = ew::rotary_threads(d.num_heads, d.num_kv_heads, d.rot_dim);
  const dim3 grid(static_cast<unsigned>(d.num_tokens));
  auto* q = static_cast<T*>(d.query);
  auto* k = static_cast<T*>(d.key);
  const auto* cs = static_cast<const CT*>(d.cos_sin_cache);
  if (d.is_neox) {
    cuda_emu::launch(&ew::rotary_embedding_kernel<T, CT, true>, grid, dim3(threads), 0,
                     "rotary_embedding_kernel<neox>", d.positions, q, k, cs, p);
  } else {
    cuda_emu::launch(&ew::rotary_embedding_kernel<T, CT, false>, grid, dim3(threads), 0,
                     "rotary_embedding_kernel<gptj>", d.positions, q, k, cs, p);
  }
}

#define EMU_INSTANTIATE_ELEMENTWISE(T)                                                \
  template void rms_norm<T>(const RowsArgs&, void*, const void*, const void*);       \
  template void fused_add_rms_norm<T>(const RowsArgs&, void*, void*, const void*);   \
  template void silu_and_mul<T>(const RowsArgs&, void*, const void*);                \
  template void rotary_embedding<T, T>(const RotaryArgs&);
EMU_INSTANTIATE_ELEMENTWISE(float)
EMU_INSTANTIATE_ELEMENTWISE(__half)
EMU_INSTANTIATE_ELEMENTWISE(__nv_bfloat16)
#undef EMU_INSTANTIATE_ELEMENTWISE
template void rotary_embedding<__half, float>(const RotaryArgs&);
template void rotary_embedding<__nv_bfloat16, float>(const RotaryArgs&);

}  // namespace emu_ops
