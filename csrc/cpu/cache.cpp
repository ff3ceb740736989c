// CPU cache ops: reshape_and_cache (+ flash layout), copy_blocks, swap_blocks.
// Layouts as in csrc/ops.h. Memory-bound copies parallelized over tokens or blocks with
// ATen's parallel_for; a negative slot is padding and writes nothing.
#include <cstring>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

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

template <typename T>
void write_cache(const CacheWriteDims& d, const at::Tensor& key, const at::Tensor& value,
                 at::Tensor& key_cache, at::Tensor& value_cache, const int64_t* slots,
                 float k_scale, float v_scale, bool flash) {
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  const int64_t H = d.num_kv_heads, D = d.head_size, bs = d.block_size, x = d.x;
  const float inv_k = 1.0f / k_scale, inv_v = 1.0f / v_scale;
  at::parallel_for(0, d.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t block = slot / bs, off = slot % bs;
      const T* ki = k + i * d.key_stride;
      const T* vi = v + i * d.value_stride;
      if (flash) {
        // [num_blocks, block_size, H, D]: a token's heads are one contiguous row.
        const int64_t base = (block * bs + off) * H * D;
        store_scaled(kc + base, ki, H * D, inv_k, 1);
        store_scaled(vc + base, vi, H * D, inv_v, 1);
        continue;
      }
      for (int64_t h = 0; h < H; ++h) {
        // key: [num_blocks, H, D/x, bs, x]; value: [num_blocks, H, D, bs].
        T* kdst = kc + ((block * H + h) * (D / x) * bs + off) * x;
        for (int64_t c = 0; c < D / x; ++c) {
          store_scaled(kdst + c * bs * x, ki + h * D + c * x, x, inv_k, 1);
        }
        store_scaled(vc + (block * H + h) * D * bs + off, vi + h * D, D, inv_v, bs);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(),
                                  "reshape_and_cache", [&] {
    write_cache<scalar_t>(d, key, value, key_cache, value_cache,
                          slot_mapping.data_ptr<int64_t>(), static_cast<float>(k_scale),
                          static_cast<float>(v_scale), flash);
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
