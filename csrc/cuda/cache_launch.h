// The launchers of the CUDA cache kernels (cache_kernels.cu), called by the torch-facing
// code (cache_ops.cpp) with validated raw pointers and sizes (see launch_types.h), and the
// host-side per-block copies of swap_blocks. No torch and no device code: the host compiler
// reads this header. Grids, layouts and limits: cache_kernels.cu.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/launch_types.h"

namespace vllm_lite {
namespace cuda {
namespace cache {

// reshape_and_cache(_flash): one token's key / value rows (key_stride / value_stride
// elements apart) into the slots slot_mapping names.
struct ReshapeAndCacheLaunch {
  FloatType dtype;           // key / value (and the cache, when cache_dtype is kAuto)
  KvCacheDType cache_dtype;
  bool flash;                // the flash layout [num_blocks, block_size, heads, head_size]
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;  // num_tokens slots; negative or past the pool: skipped
  int64_t num_tokens;
  int64_t key_stride;
  int64_t value_stride;
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t x;  // elements per 16-byte chunk of the split key layout
  int64_t element_size;  // bytes of one key / value element
  double k_scale;
  double v_scale;
};
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheLaunch& l, cudaStream_t stream);

// copy_blocks over num_layers layers: key_caches[i] / value_caches[i] hold num_blocks blocks
// of block_bytes[i] bytes each; block_mapping holds pairs (src, dst) on the device.
cudaError_t launch_copy_blocks(void* const* key_caches, void* const* value_caches,
                               const int64_t* block_bytes, int64_t num_layers,
                               const int64_t* block_mapping, int64_t pairs, int64_t num_blocks,
                               cudaStream_t stream);

// True when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) do not overlap.
inline bool disjoint(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x + static_cast<uintptr_t>(a_bytes) <= y || y + static_cast<uintptr_t>(b_bytes) <= x;
}

// swap_blocks: block map[2i] of src -> block map[2i + 1] of dst, by copy(dst, src, bytes)
// (cudaMemcpyAsync on CUDA). With merge_runs, consecutive pairs that continue a run on both
// sides (src s, s+1, ... -> dst t, t+1, ...) become one copy: a swapped-out sequence's
// blocks are often adjacent, and each call has a fixed cost. Only valid when src and dst
// do not overlap (else a later pair may read what an earlier one wrote, which one big copy
// would not honour). The mapping was validated on the host, so every run is in bounds.
template <typename Copy>
void copy_mapped_blocks(const char* src, char* dst, const int64_t* map, int64_t pairs,
                        int64_t block_bytes, bool merge_runs, Copy&& copy) {
  for (int64_t i = 0; i < pairs;) {
    int64_t n = 1;
    while (merge_runs && i + n < pairs && map[2 * (i + n)] == map[2 * i] + n &&
           map[2 * (i + n) + 1] == map[2 * i + 1] + n) {
      ++n;
    }
    copy(dst + map[2 * i + 1] * block_bytes, src + map[2 * i] * block_bytes,
         static_cast<size_t>(n * block_bytes));
    i += n;
  }
}

}  // namespace cache
}  // namespace cuda
}  // namespace vllm_lite
