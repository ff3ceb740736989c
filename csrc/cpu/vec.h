// Fixed-width float vectors and exact conversions shared by the CPU kernels that are
// compiled once per instruction set (attention_kernel.h, elementwise_kernel.h): the including
// file sets its target first, so these helpers get that target's registers.
// Everything is in an anonymous namespace: each ISA's copies stay apart.
#pragma once

#include <cstdint>
#include <cstring>

// Wide vectors must never cross a call boundary: without AVX-512 they would be passed in
// memory (GCC's -Wpsabi warning), so every helper is forced inline.
#define VLLM_LITE_INLINE inline __attribute__((always_inline))

namespace vllm_lite::cpu {
namespace {


VLLM_LITE_INLINE float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

VLLM_LITE_INLINE uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// IEEE half -> float without branches (so loops over it vectorize), exact for all inputs.
VLLM_LITE_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = (em << 13) + ((127u - 15u) << 23);
  bits = em >= 0x7c00u ? bits + ((128u - 16u) << 23) : bits;  // inf / nan
  const uint32_t sub = float_to_bits(static_cast<float>(em) * 5.9604644775390625e-08f);
  bits = em < 0x400u ? sub : bits;  // zero / subnormal: em * 2^-24
  return bits_to_float(bits | sign);
}

// Fixed-width vectors through the GCC/Clang vector extension: the compiler maps them onto
// whatever registers this file's target has (4 x SSE, 2 x AVX2 or 1 x AVX-512 for 16
// floats), with no intrinsics.
// (GCC drops vector_size on a dependent alias, so each width is spelled out.)
template <typename T, int64_t N>
struct VecOf;
#define VLLM_LITE_VEC(T, N)                                         \
  template <>                                                       \
  struct VecOf<T, N> {                                              \
    typedef T type __attribute__((vector_size(sizeof(T) * N)));     \
  };
VLLM_LITE_VEC(float, 4)
VLLM_LITE_VEC(float, 8)
VLLM_LITE_VEC(float, 16)
VLLM_LITE_VEC(uint32_t, 4)
VLLM_LITE_VEC(uint32_t, 8)
VLLM_LITE_VEC(uint32_t, 16)
VLLM_LITE_VEC(int32_t, 4)
VLLM_LITE_VEC(int32_t, 8)
VLLM_LITE_VEC(int32_t, 16)
VLLM_LITE_VEC(uint16_t, 4)
VLLM_LITE_VEC(uint16_t, 8)
VLLM_LITE_VEC(uint16_t, 16)
VLLM_LITE_VEC(uint8_t, 4)
VLLM_LITE_VEC(uint8_t, 8)
VLLM_LITE_VEC(uint8_t, 16)
#undef VLLM_LITE_VEC
template <typename T, int64_t N>
using Vec = typename VecOf<T, N>::type;

template <typename V, typename T>
VLLM_LITE_INLINE V load_vec(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename T>
VLLM_LITE_INLINE void store_vec(T* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// The branchless half_to_float, lane-wise, on half bit patterns widened to 32 bits.
template <int64_t N>
VLLM_LITE_INLINE Vec<float, N> half_lanes_to_float(Vec<uint32_t, N> h) {
  using U = Vec<uint32_t, N>;
  const U sign = (h & 0x8000u) << 16;
  const U em = h & 0x7fffu;
  U bits = (em << 13) + ((127u - 15u) << 23);
  bits = em >= 0x7c00u ? bits + ((128u - 16u) << 23) : bits;
  const Vec<float, N> sub = __builtin_convertvector(em, Vec<float, N>) * 5.9604644775390625e-08f;
  bits = em < 0x400u ? (U)sub : bits;
  return (Vec<float, N>)(bits | sign);
}

// exp(x) for x <= 0 (logits minus their max), lane-wise: 2^n * poly(r), |r| <= ln2/2,
// relative error ~2e-7; below -87 it flushes towards zero. V is float or a float vector.
template <typename V, typename I>
VLLM_LITE_INLINE V exp_nonpositive(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f;
  const V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = x - n * 0.693145751953125f;             // Cody-Waite: ln2 = hi + lo
  r = r - n * 1.42860682030941723212e-6f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return p * (V)e;
}


// silu(x) = x / (1 + exp(-x)) through e = exp(-|x|) <= 1 (the polynomial's domain):
// x >= 0: x / (1 + e); x < 0: exp(-x) = 1 / e, so x * e / (1 + e). e is h * h with
// h = exp(-|x| / 2), so that for x below -87 (where exp_nonpositive flushes) x * h * h
// still underflows gradually to the right tiny value, as torch's silu does. V a float
// vector, I the int32 vector of its width. (silu_and_mul's kernel and the gated packed GEMM's
// epilogue share it, so the fused and unfused MLPs agree bit for bit.)
template <typename V, typename I>
VLLM_LITE_INLINE V silu(V x) {
  const V neg_abs = x < 0.f ? x : -x;
  const V h = exp_nonpositive<V, I>(neg_abs * 0.5f);
  const V num = x < 0.f ? (x * h) * h : x;
  return num / (1.0f + h * h);
}

// float32 lanes -> their bfloat16 bit patterns (in the low half of U's 32-bit lanes),
// nearest even; a NaN keeps its sign and becomes quiet (as torch's cast). V a float vector.
template <typename U, typename V>
VLLM_LITE_INLINE U bf16_bits(V v) {
  const U b = (U)v;
  const U rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return (b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : rounded;
}

}  // namespace
}  // namespace vllm_lite::cpu
