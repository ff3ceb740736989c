// float32 -> fp8 encoding of the fp8 KV cache (kv_cache_dtype "fp8" = "fp8_e4m3",
// "fp8_e5m2"), one definition for the CPU kernels, the CUDA kernels and the SIMT emulator:
// plain C++ with no includes beyond <cstdint>/<cstring>, host + device under nvcc.
//
// Formats: OCP e4m3fn (3 mantissa bits, bias 7, no infinities, S.1111.111 = NaN) and e5m2
// (2 mantissa bits, bias 15, IEEE-style: the high byte of a half). Encoding rounds to
// nearest even, bit for bit as torch's float8_e4m3fn / float8_e5m2 casts (torch 2.14):
// NaN stays NaN (S.111..1 in both); e4m3fn saturates (magnitudes that round past 448,
// infinity included, become +-448); e5m2 turns magnitudes >= 61440 into infinity.
// Decoding is exact and vectorized where it runs: the per-ISA CPU attention builds in
// cpu/attention_kernel.h (an inline function of a shared header compiled under several
// targets could be merged by the linker into the wrong one), the CUDA kernels through the
// half conversion in cuda/dtype.cuh.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define VLLM_LITE_HD __host__ __device__ __forceinline__
#else
#define VLLM_LITE_HD inline
#endif

namespace vllm_lite::fp8 {

// Mantissa bits and exponent bias of the two formats.
struct E4M3 {
  static constexpr int kMantissa = 3;
  static constexpr int kBias = 7;
};
struct E5M2 {
  static constexpr int kMantissa = 2;
  static constexpr int kBias = 15;
};

VLLM_LITE_HD uint32_t float_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof(b));
  return b;
}

VLLM_LITE_HD float bits_float(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof(f));
  return f;
}

template <typename F>
VLLM_LITE_HD uint8_t from_float(float f) {
  constexpr int M = F::kMantissa, BIAS = F::kBias;
  constexpr bool kFn = M == 3;  // e4m3fn
  const uint32_t bits = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  // Overflow threshold: e4m3fn 464 = 448 + half its ulp; e5m2 2^16 (the infinity exponent).
  constexpr uint32_t kOverflow = kFn ? 0x43e80000u : 0x47800000u;
  if (a >= kOverflow) return sign | (kFn ? 0x7e : 0x7c);  // e4m3fn: 448; e5m2: infinity
  // Smallest normal: 2^(1 - BIAS). Below it the value is a multiple of 2^(1 - BIAS - M):
  // scale to an integer count of those and round half to even (the 2^23 trick is exact
  // for counts below 2^22).
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - BIAS) << 23;
  if (a < kMinNormal) {
    constexpr float kUnitsPerOne = static_cast<float>(1u << (BIAS - 1 + M));
    const float units = bits_float(a) * kUnitsPerOne;
    return sign | static_cast<uint8_t>((units + 8388608.0f) - 8388608.0f);
  }
  // Normal: drop 23 - M mantissa bits, rounding half to even (a carry moves the exponent,
  // which is right), then rebias the exponent.
  constexpr int kDrop = 23 - M;
  const uint32_t odd = (a >> kDrop) & 1u;
  const uint32_t rounded = (a + ((1u << (kDrop - 1)) - 1u) + odd) >> kDrop;
  return sign | static_cast<uint8_t>(rounded - (static_cast<uint32_t>(127 - BIAS) << M));
}


}  // namespace vllm_lite::fp8
