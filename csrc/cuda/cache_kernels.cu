// CUDA cache ops: reshape_and_cache (+ flash layout), copy_blocks, swap_blocks. This file
// holds the kernel launchers (no torch header: see launch_types.h); cache_ops.cpp the torch
// ops that check the arguments and call them.
//
// Content checks of slot mappings and copy_blocks pairs run only with
// VLLM_LITE_CHECK_VALUES=1 (a device sync each; see should_check_values in host_utils.h).
// reshape_and_cache[_flash]: grid = num_tokens, one CTA per token, up to 256 threads.
//   A slot outside [0, num_blocks * block_size) (padding is negative) writes nothing, so
//   unvalidated slot mappings (CUDA graph capture) cannot write out of bounds. Key chunks
//   (16 bytes = x elements) are copied with one 16-byte load/store when key rows and cache
//   are 16-byte aligned; the paged value layout [.., head_size, block_size] puts a token's
//   elements block_size apart, so values are stored element-wise. With a scale of 1 the
//   bits are copied; otherwise value * (1 / scale) in float32, like the CPU kernel.
//   fp8 caches (kv_cache_dtype "fp8" = "fp8_e4m3", "fp8_e5m2"; uint8 tensors, key chunk
//   x = 16): each element is stored as the fp8 rounding of value / scale (float32 division,
//   csrc/fp8.h), byte for byte what the CPU kernel writes.
// copy_blocks: grid = (num_pairs, layers), one CTA copies one block of one layer's key and
//   value cache. The layer pointers travel in the kernel's parameter block (up to 128
//   layers per launch; more layers take more launches), so there is no host-to-device
//   copy and the op can be captured in a CUDA graph. Pairs naming a block outside the pool
//   are skipped. 16-byte copies when every pointer and the block size allow, else bytes
//   (dtype-blind: fp8 uint8 caches are copied like any other).
// swap_blocks: cudaMemcpyAsync on the current stream (H2D, D2H or D2D), one per run of
//   pairs that are consecutive on both sides (one per pair if src and dst overlap). The
//   host tensor's pinned memory is recorded with torch's caching host allocator, so it is
//   not reused while the copies run.
#include <algorithm>

#include <cuda_runtime.h>

#include "cuda/cache_kernels.cuh"
#include "cuda/dtype.cuh"

namespace vllm_lite {
namespace cuda {
namespace cache {

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheLaunch& l, cudaStream_t stream) {
  const CacheArgs a = make_cache_args(l.key_stride, l.value_stride, l.num_blocks, l.block_size,
                                      l.num_kv_heads, l.head_size, l.element_size, l.k_scale,
                                      l.v_scale, l.key, l.value, l.key_cache, l.value_cache);
  const int64_t n = l.num_kv_heads * l.head_size;
  // Items of the widest loop (an fp8 flash row is converted element by element).
  const bool fp8 = l.cache_dtype != KvCacheDType::kAuto;
  const int threads = cache_threads(l.flash && !fp8 ? n / l.x : n);
  const unsigned grid = static_cast<unsigned>(l.num_tokens);
  dispatch_float_type(l.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_elem<scalar_t>(l.cache_dtype, [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      const auto* k = static_cast<const scalar_t*>(l.key);
      const auto* v = static_cast<const scalar_t*>(l.value);
      auto* kc = static_cast<cache_t*>(l.key_cache);
      auto* vc = static_cast<cache_t*>(l.value_cache);
      if (l.flash) {
        reshape_and_cache_kernel<scalar_t, cache_t, true>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, l.slot_mapping, a);
      } else {
        reshape_and_cache_kernel<scalar_t, cache_t, false>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, l.slot_mapping, a);
      }
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(void* const* key_caches, void* const* value_caches,
                               const int64_t* block_bytes, int64_t num_layers,
                               const int64_t* block_mapping, int64_t pairs, int64_t num_blocks,
                               cudaStream_t stream) {
  for (int64_t l0 = 0; l0 < num_layers; l0 += kMaxCopyLayers) {
    const int64_t count = std::min<int64_t>(kMaxCopyLayers, num_layers - l0);
    CopyBlocksLayers layers{};
    bool vec = true;
    int64_t max_bytes = 0;
    for (int64_t i = 0; i < count; ++i) {
      layers.key[i] = reinterpret_cast<int64_t>(key_caches[l0 + i]);
      layers.value[i] = reinterpret_cast<int64_t>(value_caches[l0 + i]);
      layers.block_bytes[i] = block_bytes[l0 + i];
      vec = vec && is_aligned16(key_caches[l0 + i]) && is_aligned16(value_caches[l0 + i]) &&
            layers.block_bytes[i] % 16 == 0;
      max_bytes = std::max(max_bytes, layers.block_bytes[i]);
    }
    if (max_bytes == 0) continue;
    const int64_t units = vec ? max_bytes / 16 : max_bytes;
    const int threads = cache_threads(units);
    const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(count));
    if (vec) {
      copy_blocks_kernel<uint4><<<grid, threads, 0, stream>>>(layers, block_mapping, num_blocks);
    } else {
      copy_blocks_kernel<unsigned char>
          <<<grid, threads, 0, stream>>>(layers, block_mapping, num_blocks);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cache
}  // namespace cuda
}  // namespace vllm_lite
