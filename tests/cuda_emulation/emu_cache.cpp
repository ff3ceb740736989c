// Replays cache_kernels.cu's host code (reshape_and_cache(_flash), copy_blocks,
// swap_blocks) on the emulator, with the kernels of csrc/cuda/cache_kernels.cuh.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cuda/cache_kernels.cuh"
#include "emu_ops.h"
#include "emu_runtime.h"

namespace emu_ops {

namespace cache = vllm_lite::cuda::cache;

template <typename T, typename CT>
void reshape_and_cache(const CacheWriteArgs& d, bool flash) {
  if (d.num_tokens == 0 || d.num_kv_heads == 0) return;
  const cache::CacheArgs a = cache::make_cache_args(
      d.key_stride, d.value_stride, d.num_blocks, d.block_size, d.num_kv_heads, d.head_size,
      sizeof(T), d.k_scale, d.v_scale, d.key, d.value, d.key_cache, d.value_cache);
  const int64_t n = d.num_kv_heads * d.head_size;
  const int64_t x = 16 / static_cast<int64_t>(sizeof(CT));
  constexpr bool fp8 = !std::is_same_v<T, CT>;
  const int threads = cache::cache_threads(flash && !fp8 ? n / x : n);
  const auto* k = static_cast<const T*>(d.key);
  const auto* v = static_cast<const T*>(d.value);
  auto* kc = static_cast<CT*>(d.key_cache);
  auto* vc = static_cast<CT*>(d.value_cache);
  const dim3 grid(static_cast<unsigned>(d.num_tokens));
  if (flash) {
    cuda_emu::launch(&cache::reshape_and_cache_kernel<T, CT, true>, grid, dim3(threads), 0,
                     "reshape_and_cache_kernel<flash>", k, v, kc, vc, d.slot_mapping, a);
  } else {
    cuda_emu::launch(&cache::reshape_and_cache_kernel<T, CT, false>, grid, dim3(threads), 0,
                     "reshape_and_cache_kernel", k, v, kc, vc, d.slot_mapping, a);
  }
}

using vllm_lite::cuda::fp8_e4m3;
using vllm_lite::cuda::fp8_e5m2;
#define EMU_INSTANTIATE_CACHE(T)                                                \
  template void reshape_and_cache<T, T>(const CacheWriteArgs&, bool);          \
  template void reshape_and_cache<T, fp8_e4m3>(const CacheWriteArgs&, bool);   \
  template void reshape_and_cache<T, fp8_e5m2>(const CacheWriteArgs&, bool);
EMU_INSTANTIATE_CACHE(float)
EMU_INSTANTIATE_CACHE(__half)
EMU_INSTANTIATE_CACHE(__nv_bfloat16)
#undef EMU_INSTANTIATE_CACHE

void copy_blocks(void* const* key_caches, void* const* value_caches,
                 const int64_t* block_bytes, int64_t num_layers, const int64_t* mapping,
                 int64_t pairs, int64_t num_blocks) {
  if (num_layers == 0 || pairs == 0 || num_blocks == 0) return;
  for (int64_t l0 = 0; l0 < num_layers; l0 += cache::kMaxCopyLayers) {
    const int64_t count = std::min<int64_t>(cache::kMaxCopyLayers, num_layers - l0);
    cache::CopyBlocksLayers layers{};
    bool vec = true;
    int64_t max_bytes = 0;
    for (int64_t i = 0; i < count; ++i) {
      layers.key[i] = reinterpret_cast<int64_t>(key_caches[l0 + i]);
      layers.value[i] = reinterpret_cast<int64_t>(value_caches[l0 + i]);
      layers.block_bytes[i] = block_bytes[l0 + i];
      vec = vec && vllm_lite::cuda::is_aligned16(key_caches[l0 + i]) &&
            vllm_lite::cuda::is_aligned16(value_caches[l0 + i]) &&
            layers.block_bytes[i] % 16 == 0;
      max_bytes = std::max(max_bytes, layers.block_bytes[i]);
    }
    if (max_bytes == 0) continue;
    const int64_t units = vec ? max_bytes / 16 : max_bytes;
    const int threads = cache::cache_threads(units);
    const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(count));
    if (vec) {
      cuda_emu::launch(&cache::copy_blocks_kernel<uint4>, grid, dim3(threads), 0,
                       "copy_blocks_kernel<uint4>", layers, mapping, num_blocks);
    } else {
      cuda_emu::launch(&cache::copy_blocks_kernel<unsigned char>, grid, dim3(threads), 0,
                       "copy_blocks_kernel<uchar>", layers, mapping, num_blocks);
    }
  }
}

int64_t swap_blocks(const void* src, void* dst, const int64_t* mapping, int64_t pairs,
                    int64_t block_bytes, int64_t src_blocks, int64_t dst_blocks) {
  if (block_bytes == 0 || pairs == 0) return 0;
  const bool merge_runs = cache::disjoint(src, src_blocks * block_bytes, dst,
                                          dst_blocks * block_bytes);
  int64_t copies = 0;
  cache::copy_mapped_blocks(static_cast<const char*>(src), static_cast<char*>(dst), mapping,
                            pairs, block_bytes, merge_runs,
                            [&](char* to, const char* from, size_t n) {
                              memcpy(to, from, n);
                              ++copies;
                            });
  return copies;
}

}  // namespace emu_ops
