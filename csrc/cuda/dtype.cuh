// Element types of the CUDA kernels and their float32 conversions.
//
// Kernels are templated on the CUDA-native element type (float, __half, __nv_bfloat16);
// launchers map a FloatType (launch_types.h) to it with dispatch_float_type, and the cache
// element type with dispatch_cache_elem. No torch header: see launch_types.h. All math is
// float32: loads convert to float, stores round to nearest even. torch compiles CUDA with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so every conversion here
// is an explicit intrinsic or bit operation, never an implicit cast.
//
// A "chunk" is 16 bytes (one uint4 load): 4 floats, 8 half / bfloat16 values or 16 fp8
// bytes, which is also the x of the key-cache layout
// [num_blocks, num_kv_heads, head_size / x, block_size, x] (x = 16 for an fp8 cache, as
// validate.cpp's key_chunk_elems and the CPU kernels define it).
//
// Cache element types: the kernels take the query / output type T and the cache element
// type CT separately; CT = T for kv_cache_dtype "auto", fp8_e4m3 / fp8_e5m2 (one byte of
// a uint8 cache, encoded by csrc/fp8.h as the CPU kernels encode, decoded exactly through
// the half conversion below) for "fp8" / "fp8_e4m3" / "fp8_e5m2".
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../fp8.h"
#include "launch_types.h"

namespace vllm_lite {
namespace cuda {

// One byte of an fp8 cache in format F (fp8::E4M3 or fp8::E5M2). A distinct type per
// format, so the kernel templates pick the conversion at compile time.
template <typename F>
struct fp8_t {
  uint8_t bits;
};
using fp8_e4m3 = fp8_t<fp8::E4M3>;
using fp8_e5m2 = fp8_t<fp8::E5M2>;

template <typename F>
F fp8_format(fp8_t<F>);  // the format of an fp8 element type (unevaluated use only)

template <typename T>
inline constexpr bool is_fp8_v = false;
template <typename F>
inline constexpr bool is_fp8_v<fp8_t<F>> = true;

// The kv_cache_dtype name of cache element CT for model dtype T (for messages).
template <typename T, typename CT>
constexpr const char* cache_dtype_name() {
  if constexpr (std::is_same_v<CT, fp8_e4m3>) {
    return "fp8_e4m3";
  } else if constexpr (std::is_same_v<CT, fp8_e5m2>) {
    return "fp8_e5m2";
  } else {
    static_assert(std::is_same_v<CT, T>, "a cache element is T or an fp8 type");
    return "auto";
  }
}

// Elements of T in one 16-byte chunk.
template <typename T>
inline constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename F>
__device__ __forceinline__ void fp8_word_to_float(uint32_t w, float* out);

template <typename F>
__device__ __forceinline__ float to_float(fp8_t<F> v) {
  float out[4];
  fp8_word_to_float<F>(v.bits, out);
  return out[0];
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// fp8: round to nearest even, saturating / NaN as torch's float8 casts (csrc/fp8.h).
template <>
__device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float v) {
  return fp8_e4m3{fp8::from_float<fp8::E4M3>(v)};
}
template <>
__device__ __forceinline__ fp8_e5m2 from_float<fp8_e5m2>(float v) {
  return fp8_e5m2{fp8::from_float<fp8::E5M2>(v)};
}

// 16-byte load through the read-only path; p must be 16-byte aligned.
__device__ __forceinline__ uint4 load_chunk(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 8-byte load (the low half of a chunk; .z = .w = 0); p must be 8-byte aligned. For the
// value rows of an fp8 cache at block size 8, which are 8 bytes: a 16-byte load there
// would read past the row (and, for the last row of the pool, past the cache).
__device__ __forceinline__ uint4 load_half_chunk(const void* p) {
  const uint2 h = __ldg(reinterpret_cast<const uint2*>(p));
  return make_uint4(h.x, h.y, 0u, 0u);
}

__device__ __forceinline__ uint4 zero_chunk() { return make_uint4(0u, 0u, 0u, 0u); }

// Unpacks one 16-byte chunk into kChunkElems<T> floats (element 0 = lowest address).
template <typename T>
__device__ __forceinline__ void chunk_to_float(const uint4& c, float* out);

template <>
__device__ __forceinline__ void chunk_to_float<float>(const uint4& c, float* out) {
  out[0] = __uint_as_float(c.x);
  out[1] = __uint_as_float(c.y);
  out[2] = __uint_as_float(c.z);
  out[3] = __uint_as_float(c.w);
}

template <>
__device__ __forceinline__ void chunk_to_float<__half>(const uint4& c, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], sizeof(h));
    const float2 f = __half22float2(h);  // .x is the low half (lower address)
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void chunk_to_float<__nv_bfloat16>(const uint4& c, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bfloat16 -> float is exact: the high 16 bits
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// fp8: 4 bytes of a word (byte 0 = lowest address) -> 4 floats. Each byte is moved into
// the bit pattern of a half and widened by the half -> float conversion, two at a time:
// e5m2 is the high byte of a half; e4m3fn's sign, exponent and mantissa land in a half's
// fields with a bias 8 too high, which the exact multiply by 2^8 undoes (subnormals
// included: the half conversion gives normal floats, so flush-to-zero never applies).
// Only e4m3fn's S.1111.111 (NaN; as a half it reads 480) needs a select.
__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof(h));
  return __half22float2(h);  // .x: the low 16 bits
}

template <typename F>
__device__ __forceinline__ void fp8_word_to_float(uint32_t w, float* out) {
  if constexpr (F::kMantissa == 2) {
    const float2 lo = half2_bits_to_float2(((w & 0xffu) << 8) | ((w & 0xff00u) << 16));
    const float2 hi = half2_bits_to_float2(((w >> 8) & 0xff00u) | (w & 0xff000000u));
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
  } else {
    const uint32_t s = w & 0x80808080u, m = w & 0x7f7f7f7fu;
    const float2 lo = half2_bits_to_float2(((s & 0xffu) << 8) | ((m & 0xffu) << 7) |
                                           ((s & 0xff00u) << 16) | ((m & 0xff00u) << 15));
    const float2 hi = half2_bits_to_float2(((s >> 8) & 0xff00u) | ((m >> 9) & 0x7f80u) |
                                           (s & 0xff000000u) | ((m & 0x7f000000u) >> 1));
    const float v[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[i] = ((m >> (8 * i)) & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : v[i] * 256.0f;
    }
  }
}

template <>
__device__ __forceinline__ void chunk_to_float<fp8_e4m3>(const uint4& c, float* out) {
  fp8_word_to_float<fp8::E4M3>(c.x, out);
  fp8_word_to_float<fp8::E4M3>(c.y, out + 4);
  fp8_word_to_float<fp8::E4M3>(c.z, out + 8);
  fp8_word_to_float<fp8::E4M3>(c.w, out + 12);
}

template <>
__device__ __forceinline__ void chunk_to_float<fp8_e5m2>(const uint4& c, float* out) {
  fp8_word_to_float<fp8::E5M2>(c.x, out);
  fp8_word_to_float<fp8::E5M2>(c.y, out + 4);
  fp8_word_to_float<fp8::E5M2>(c.z, out + 8);
  fp8_word_to_float<fp8::E5M2>(c.w, out + 12);
}

// Bytes and elements of N consecutive elements of T loaded as one unit: a whole chunk, or
// (fp8 only) half a chunk.
template <typename T, int N>
inline constexpr int kUnitBytes = N * static_cast<int>(sizeof(T));

// Loads N consecutive elements of T at p (N * sizeof(T) is 16, or 8 for fp8; p aligned to
// that) as a chunk.
template <typename T, int N>
__device__ __forceinline__ uint4 load_unit(const T* p) {
  static_assert(kUnitBytes<T, N> == 16 || (is_fp8_v<T> && kUnitBytes<T, N> == 8), "unit");
  if constexpr (kUnitBytes<T, N> == 16) {
    return load_chunk(p);
  } else {
    return load_half_chunk(p);
  }
}

// N elements of T, stride elements apart from p (the flash layout's tokens of one dim), in
// load_unit<T, N>'s chunk (element i at byte i * sizeof(T)).
template <typename T, int N>
__device__ __forceinline__ uint4 load_unit_strided(const T* p, int64_t stride) {
  static_assert(kUnitBytes<T, N> == 16 || (is_fp8_v<T> && kUnitBytes<T, N> == 8), "unit");
  uint4 c = zero_chunk();
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&c);
#pragma unroll
  for (int i = 0; i < N; ++i) memcpy(bytes + i * sizeof(T), p + i * stride, sizeof(T));
  return c;
}

// The first N elements of a chunk from load_unit<T, N> -> N floats.
template <typename T, int N>
__device__ __forceinline__ void unit_to_float(const uint4& c, float* out) {
  if constexpr (kUnitBytes<T, N> == 16) {
    chunk_to_float<T>(c, out);
  } else {
    static_assert(is_fp8_v<T> && N == 8, "a half chunk exists only for fp8");
    using F = decltype(fp8_format(T{}));
    fp8_word_to_float<F>(c.x, out);
    fp8_word_to_float<F>(c.y, out + 4);
  }
}

// Calls f(T{}) with T the CUDA-native element type of t.
template <typename Fn>
decltype(auto) dispatch_float_type(FloatType t, Fn&& f) {
  switch (t) {
    case FloatType::kFloat16:
      return f(__half{});
    case FloatType::kBFloat16:
      return f(__nv_bfloat16{});
    case FloatType::kFloat32:
    default:
      return f(float{});
  }
}

// Calls f(CT{}) with CT the cache element type of a kernel whose model dtype is T: T itself
// for kv_cache_dtype "auto", fp8_e4m3 / fp8_e5m2 for the fp8 kinds (uint8 caches; the
// shapes, the dtype and the head_size % 16 of the fp8 key layout are checked in
// validate.cpp).
template <typename T, typename Fn>
void dispatch_cache_elem(KvCacheDType kind, Fn&& f) {
  switch (kind) {
    case KvCacheDType::kFp8E4M3:
      f(fp8_e4m3{});
      return;
    case KvCacheDType::kFp8E5M2:
      f(fp8_e5m2{});
      return;
    case KvCacheDType::kAuto:
      f(T{});
      return;
  }
}

}  // namespace cuda
}  // namespace vllm_lite
