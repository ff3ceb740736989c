// CPU cache ops: reshape_and_cache (+ flash layout), copy_blocks, swap_blocks.
// Layouts as in csrc/ops.h; an fp8 cache (kv_cache_dtype "fp8*") is uint8 with x = 16.
// Memory-bound copies parallelized over tokens or blocks with ATen's parallel_for; a
// negative slot is padding and writes nothing.
#include <cstring>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "fp8.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

// Copies n elements, dividing by scale unless it is 1 (then the bits are copied).
template <typename T>
inline void store_scaled(T* dst, const T* src, int64_t n, float inv_scale, int64_t dst_stride) {
  if (inv_scale == 1.0f) {
    if (dst_stride == 1) {
      std::memcpy(dst, src, n * sizeof(T));
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i * dst_stride] = src[i];
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    dst[i * dst_stride] = static_cast<T>(static_cast<float>(src[i]) * inv_scale);
  }
}

// Copies n elements into fp8: element / scale in float32 (a true division, as a float32
// tensor divided by the scale), then rounded to fp8.
template <typename T, typename F>
inline void store_fp8(uint8_t* dst, const T* src, int64_t n, float scale, int64_t dst_stride) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i * dst_stride] = fp8::from_float<F>(static_cast<float>(src[i]) / scale);
  }
}

// Touches, for writing, the cache lines that n elements at dst_stride elements apart span.
template <typename C>
inline void prefetch_dst(const C* dst, int64_t n, int64_t dst_stride) {
  constexpr int64_t kLine = 64;
  const auto* p = reinterpret_cast<const char*>(dst);
  const int64_t step = dst_stride * static_cast<int64_t>(sizeof(C));
  if (step >= kLine) {
    for (int64_t i = 0; i < n; ++i) __builtin_prefetch(p + i * step, 1, 3);
  } else {
    const int64_t span = (n - 1) * step + static_cast<int64_t>(sizeof(C));
    for (int64_t b = 0; b < span; b += kLine) __builtin_prefetch(p + b, 1, 3);
    __builtin_prefetch(p + span - 1, 1, 3);
  }
}

// Tokens whose destination lines are requested before the current token is written. A
// decode step's tokens each land in another sequence's block, in lines the step's weights
// have evicted: written one after another, every store waits for its line (a bf16 9/3x64
// token's K and V span 120 lines), while requested ahead their misses overlap. Two tokens
// keep ~240 lines in flight, more than a core's miss buffers hold.
constexpr int64_t kCacheWriteAhead = 2;

// Writes the tokens' keys and values into the caches; C is the cache element (T for
// kv_cache_dtype "auto", uint8 for fp8) and Store(dst, src, n, scale, dst_stride) converts.
template <typename T, typename C, typename Store>
void write_cache(const CacheWriteDims& d, const at::Tensor& key, const at::Tensor& value,
                 at::Tensor& key_cache, at::Tensor& value_cache, const int64_t* slots,
                 float k_scale, float v_scale, bool flash, Store&& store) {
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  C* kc = static_cast<C*>(key_cache.data_ptr());
  C* vc = static_cast<C*>(value_cache.data_ptr());
  const int64_t H = d.num_kv_heads, D = d.head_size, bs = d.block_size, x = d.x;
  // Requests the lines token i's key and value go to (nothing for padding).
  const auto prefetch_token = [&](int64_t i) {
    const int64_t slot = slots[i];
    if (slot < 0) return;
    const int64_t block = slot / bs, off = slot % bs;
    if (flash) {
      const int64_t base = (block * bs + off) * H * D;
      prefetch_dst(kc + base, H * D, 1);
      prefetch_dst(vc + base, H * D, 1);
      return;
    }
    for (int64_t h = 0; h < H; ++h) {
      prefetch_dst(kc + ((block * H + h) * (D / x) * bs + off) * x, D / x, bs * x);
      prefetch_dst(vc + (block * H + h) * D * bs + off, D, bs);
    }
  };
  at::parallel_for(0, d.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && i < begin + kCacheWriteAhead; ++i) prefetch_token(i);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kCacheWriteAhead < end) prefetch_token(i + kCacheWriteAhead);
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t block = slot / bs, off = slot % bs;
      const T* ki = k + i * d.key_stride;
      const T* vi = v + i * d.value_stride;
      if (flash) {
        // [num_blocks, block_size, H, D]: a token's heads are one contiguous row.
        const int64_t base = (block * bs + off) * H * D;
        store(kc + base, ki, H * D, k_scale, 1);
        store(vc + base, vi, H * D, v_scale, 1);
        continue;
      }
      for (int64_t h = 0; h < H; ++h) {
        // key: [num_blocks, H, D/x, bs, x]; value: [num_blocks, H, D, bs].
        C* kdst = kc + ((block * H + h) * (D / x) * bs + off) * x;
        for (int64_t c = 0; c < D / x; ++c) {
          store(kdst + c * bs * x, ki + h * D + c * x, x, k_scale, 1);
        }
        store(vc + (block * H + h) * D * bs + off, vi + h * D, D, v_scale, bs);
      }
    }
  });
}

void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache,
                            const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                            double k_scale, double v_scale, bool flash) {
  const auto d = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                         kv_cache_dtype, k_scale, v_scale, flash);
  check_slot_mapping_values(d, slot_mapping);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(),
                                  "reshape_and_cache", [&] {
    using T = scalar_t;
    switch (d.cache_dtype) {
      case KvCacheDType::kAuto:
        write_cache<T, T>(d, key, value, key_cache, value_cache, slots, ks, vs, flash,
                          [](T* dst, const T* src, int64_t n, float scale, int64_t stride) {
                            store_scaled(dst, src, n, 1.0f / scale, stride);
                          });
        break;
      case KvCacheDType::kFp8E4M3:
        write_cache<T, uint8_t>(d, key, value, key_cache, value_cache, slots, ks, vs, flash,
                                &store_fp8<T, fp8::E4M3>);
        break;
      case KvCacheDType::kFp8E5M2:
        write_cache<T, uint8_t>(d, key, value, key_cache, value_cache, slots, ks, vs, flash,
                                &store_fp8<T, fp8::E5M2>);
        break;
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  reshape_and_cache_impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                         k_scale, v_scale, /*flash=*/false);
}

void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                             double k_scale, double v_scale) {
  reshape_and_cache_impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                         k_scale, v_scale, /*flash=*/true);
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  check_copy_blocks(key_caches, value_caches, block_mapping, /*check_values=*/true);
  const int64_t pairs = block_mapping.size(0);
  if (key_caches.empty() || pairs == 0) return;
  const int64_t* map = block_mapping.data_ptr<int64_t>();
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  // One task per (layer, K or V, pair): each copies one whole block.
  at::parallel_for(0, layers * 2 * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i % pairs, kv = (i / pairs) % 2, layer = i / (2 * pairs);
      const at::Tensor& cache = kv == 0 ? key_caches[layer] : value_caches[layer];
      const int64_t block_bytes = cache.numel() / cache.size(0) * cache.element_size();
      auto* base = static_cast<char*>(cache.data_ptr());
      std::memmove(base + map[2 * pair + 1] * block_bytes, base + map[2 * pair] * block_bytes,
                  block_bytes);
    }
  });
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(),
              "swap_blocks: the CPU kernel needs src and dst on the CPU, got ", src.device(),
              " and ", dst.device());
  const int64_t block_bytes = check_swap_blocks(src, dst, block_mapping);
  const int64_t* map = block_mapping.data_ptr<int64_t>();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* dptr = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, block_mapping.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(dptr + map[2 * i + 1] * block_bytes, s + map[2 * i] * block_bytes,
                  block_bytes);
    }
  });
}

}  // namespace vllm_lite::cpu
