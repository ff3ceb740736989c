// Kernels of the CUDA cache ops (cache_kernels.cu): reshape_and_cache(_flash) and
// copy_blocks, plus the host-side choices their launchers make (threads per CTA, copy
// paths). Kept in a header so the CPU emulation of the
// kernels (tests/cuda_emulation) compiles exactly this code; cache_kernels.cu is its only
// CUDA user. Grids, layouts and limits: see cache_kernels.cu.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/cache_launch.h"
#include "cuda/dtype.cuh"

namespace vllm_lite {
namespace cuda {
namespace cache {

constexpr int kCacheThreads = 256;

struct CacheArgs {
  int64_t key_stride;    // elements between tokens of key
  int64_t value_stride;  // elements between tokens of value
  int64_t num_slots;     // num_blocks * block_size
  int num_kv_heads;
  int head_size;
  int block_size;
  float k_scale;  // fp8 caches store value / scale (a true division, as the CPU op)
  float v_scale;
  float inv_k;  // 1 / k_scale: caches in the model dtype store value * inv
  float inv_v;
  bool raw_k;  // inv_k == 1 (and the cache holds the model dtype): copy bits
  bool raw_v;
  bool vec_k;  // 16-byte aligned key rows and key cache
  bool vec_v;  // 16-byte aligned value rows and value cache (flash layout only)
};

// One element of the cache from one of the model's: CT = T (kv_cache_dtype "auto")
// copies the bits (raw) or stores v * (1 / scale) rounded to T; an fp8 CT stores the fp8
// rounding of v / scale, computed in float32 exactly as the CPU kernel (csrc/cpu/cache.cpp)
// does, so both write the same bytes. The division is __fdiv_rn, the IEEE one: the build
// uses --use_fast_math, under which `/` is an approximation that could move a quotient
// across an fp8 rounding boundary. (Its flush of float32 subnormals to zero cannot change
// a byte: such a quotient, or such an input over any scale above 1e-30, is fp8 zero.)
template <typename T, typename CT>
__device__ __forceinline__ CT cache_elem(T v, float scale, float inv, bool raw) {
  if constexpr (std::is_same_v<T, CT>) {
    return raw ? v : from_float<T>(to_float(v) * inv);
  } else {
    static_assert(is_fp8_v<CT>, "a cache holds the model dtype or fp8");
    return from_float<CT>(__fdiv_rn(to_float(v), scale));
  }
}

// dst[0, n) = src[0, n) (converted), by the CTA's threads; n is a multiple of the chunk of
// CT when the 16-byte path (same type, raw, aligned) is taken.
template <typename T, typename CT>
__device__ __forceinline__ void copy_row(const T* src, CT* dst, int n, float scale, float inv,
                                         bool raw, bool vec) {
  constexpr int X = kChunkElems<CT>;
  if (std::is_same_v<T, CT> && raw && vec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int c = threadIdx.x; c < n / X; c += blockDim.x) d[c] = s[c];
  } else {
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      dst[e] = cache_elem<T, CT>(src[e], scale, inv, raw);
    }
  }
}

// T: the model dtype of key / value; CT: the cache element (T, or fp8_e4m3 / fp8_e5m2 for
// a uint8 cache). x = kChunkElems<CT> (16 for fp8).
template <typename T, typename CT, bool FLASH>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         CT* __restrict__ key_cache, CT* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         const CacheArgs a) {
  constexpr int X = kChunkElems<CT>;
  constexpr bool kSame = std::is_same_v<T, CT>;
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an unvalidated bad slot)
  const int n = a.num_kv_heads * a.head_size;   // elements of one token
  const T* k = key + token * a.key_stride;
  const T* v = value + token * a.value_stride;
  const bool raw_k = kSame && a.raw_k;
  const bool raw_v = kSame && a.raw_v;

  if (FLASH) {
    // [num_blocks, block_size, num_kv_heads, head_size]: the token's row starts at slot * n.
    copy_row(k, key_cache + slot * n, n, a.k_scale, a.inv_k, raw_k, a.vec_k);
    copy_row(v, value_cache + slot * n, n, a.v_scale, a.inv_v, raw_v, a.vec_v);
    return;
  }
  const int64_t block = slot / a.block_size;
  const int off = static_cast<int>(slot - block * a.block_size);
  const int nck = a.head_size / X;  // chunks per head
  // key [num_blocks, H, head_size / x, block_size, x]: chunk c = (head h, chunk dc).
  for (int c = threadIdx.x; c < n / X; c += blockDim.x) {
    const int h = c / nck;
    const int dc = c - h * nck;
    CT* dst = key_cache + (((block * a.num_kv_heads + h) * nck + dc) * a.block_size + off) * X;
    const T* src = k + c * X;
    if (raw_k && a.vec_k) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < X; ++e) dst[e] = cache_elem<T, CT>(src[e], a.k_scale, a.inv_k, raw_k);
    }
  }
  // value [num_blocks, H, head_size, block_size]: element e = (head h, dim d).
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int h = e / a.head_size;
    const int d = e - h * a.head_size;
    value_cache[((block * a.num_kv_heads + h) * a.head_size + d) * a.block_size + off] =
        cache_elem<T, CT>(v[e], a.v_scale, a.inv_v, raw_v);
  }
}

// Threads per CTA of the cache kernels: one per work item (rounded up to a warp, at least
// one warp), at most kCacheThreads.
inline int cache_threads(int64_t work) {
  const int64_t w = (work + 31) / 32 * 32;
  return static_cast<int>(w < 32 ? 32 : (w > kCacheThreads ? kCacheThreads : w));
}

// reshape_and_cache's arguments from the (validated) shapes, strides, scales and pointers;
// esize is the element size of key / value in bytes. vec_* only matter when the cache holds
// the model dtype (the kernel copies fp8 element-wise).
inline CacheArgs make_cache_args(int64_t key_stride, int64_t value_stride, int64_t num_blocks,
                                 int64_t block_size, int64_t num_kv_heads, int64_t head_size,
                                 int64_t esize, double k_scale, double v_scale, const void* key,
                                 const void* value, const void* key_cache,
                                 const void* value_cache) {
  CacheArgs a{};
  a.key_stride = key_stride;
  a.value_stride = value_stride;
  a.num_slots = num_blocks * block_size;
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_size = static_cast<int>(head_size);
  a.block_size = static_cast<int>(block_size);
  a.k_scale = static_cast<float>(k_scale);
  a.v_scale = static_cast<float>(v_scale);
  a.inv_k = 1.0f / static_cast<float>(k_scale);
  a.inv_v = 1.0f / static_cast<float>(v_scale);
  a.raw_k = a.inv_k == 1.0f;
  a.raw_v = a.inv_v == 1.0f;
  a.vec_k = is_aligned16(key) && (key_stride * esize) % 16 == 0 && is_aligned16(key_cache);
  a.vec_v =
      is_aligned16(value) && (value_stride * esize) % 16 == 0 && is_aligned16(value_cache);
  return a;
}

constexpr int kMaxCopyLayers = 128;  // 3 KiB of kernel parameters

struct CopyBlocksLayers {
  int64_t key[kMaxCopyLayers];          // data pointers
  int64_t value[kMaxCopyLayers];
  int64_t block_bytes[kMaxCopyLayers];  // bytes of one block (same for key and value)
};

// U: copy unit (uint4 when 16-byte aligned, else unsigned char).
template <typename U>
__global__ void copy_blocks_kernel(const __grid_constant__ CopyBlocksLayers layers,
                                   const int64_t* __restrict__ block_mapping,
                                   int64_t num_blocks) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  const int64_t n = layers.block_bytes[layer] / static_cast<int64_t>(sizeof(U));
  U* k = reinterpret_cast<U*>(layers.key[layer]);
  U* v = reinterpret_cast<U*>(layers.value[layer]);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    k[dst * n + i] = k[src * n + i];
    v[dst * n + i] = v[src * n + i];
  }
}

}  // namespace cache
}  // namespace cuda
}  // namespace vllm_lite
