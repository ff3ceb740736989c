// CUDA cache ops: reshape_and_cache (+ flash layout), copy_blocks, swap_blocks.
//
// reshape_and_cache[_flash]: grid = num_tokens, one CTA per token, up to 256 threads.
//   A slot outside [0, num_blocks * block_size) (padding is negative) writes nothing, so
//   unvalidated slot mappings (CUDA graph capture) cannot write out of bounds. Key chunks
//   (16 bytes = x elements) are copied with one 16-byte load/store when key rows and cache
//   are 16-byte aligned; the paged value layout [.., head_size, block_size] puts a token's
//   elements block_size apart, so values are stored element-wise. With a scale of 1 the
//   bits are copied; otherwise value * (1 / scale) in float32, like the CPU kernel.
// copy_blocks: grid = (num_pairs, layers), one CTA copies one block of one layer's key and
//   value cache. The layer pointers travel in the kernel's parameter block (up to 128
//   layers per launch; more layers take more launches), so there is no host-to-device
//   copy and the op can be captured in a CUDA graph. Pairs naming a block outside the pool
//   are skipped. 16-byte copies when every pointer and the block size allow, else bytes.
// swap_blocks: one cudaMemcpyAsync per block on the current stream (H2D, D2H or D2D).
#include <algorithm>
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_utils.cuh"
#include "cuda/dtype.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace {

constexpr int kCacheThreads = 256;

struct CacheArgs {
  int64_t key_stride;    // elements between tokens of key
  int64_t value_stride;  // elements between tokens of value
  int64_t num_slots;     // num_blocks * block_size
  int num_kv_heads;
  int head_size;
  int block_size;
  float inv_k;  // 1 / k_scale
  float inv_v;
  bool raw_k;  // inv_k == 1: copy bits
  bool raw_v;
  bool vec_k;  // 16-byte aligned key rows and key cache
  bool vec_v;  // 16-byte aligned value rows and value cache (flash layout only)
};

template <typename T>
__device__ __forceinline__ T scaled(T v, float inv, bool raw) {
  return raw ? v : from_float<T>(to_float(v) * inv);
}

// dst[0, n) = src[0, n) (scaled), by the CTA's threads; n is a multiple of the chunk.
template <typename T>
__device__ __forceinline__ void copy_row(const T* src, T* dst, int n, float inv, bool raw,
                                         bool vec) {
  constexpr int X = kChunkElems<T>;
  if (raw && vec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int c = threadIdx.x; c < n / X; c += blockDim.x) d[c] = s[c];
  } else {
    for (int e = threadIdx.x; e < n; e += blockDim.x) dst[e] = scaled(src[e], inv, raw);
  }
}

template <typename T, bool FLASH>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         const CacheArgs a) {
  constexpr int X = kChunkElems<T>;
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an unvalidated bad slot)
  const int n = a.num_kv_heads * a.head_size;   // elements of one token
  const T* k = key + token * a.key_stride;
  const T* v = value + token * a.value_stride;

  if (FLASH) {
    // [num_blocks, block_size, num_kv_heads, head_size]: the token's row starts at slot * n.
    copy_row(k, key_cache + slot * n, n, a.inv_k, a.raw_k, a.vec_k);
    copy_row(v, value_cache + slot * n, n, a.inv_v, a.raw_v, a.vec_v);
    return;
  }
  const int64_t block = slot / a.block_size;
  const int off = static_cast<int>(slot - block * a.block_size);
  const int nck = a.head_size / X;  // chunks per head
  // key [num_blocks, H, head_size / x, block_size, x]: chunk c = (head h, chunk dc).
  for (int c = threadIdx.x; c < n / X; c += blockDim.x) {
    const int h = c / nck;
    const int dc = c - h * nck;
    T* dst = key_cache + (((block * a.num_kv_heads + h) * nck + dc) * a.block_size + off) * X;
    const T* src = k + c * X;
    if (a.raw_k && a.vec_k) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < X; ++e) dst[e] = scaled(src[e], a.inv_k, a.raw_k);
    }
  }
  // value [num_blocks, H, head_size, block_size]: element e = (head h, dim d).
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int h = e / a.head_size;
    const int d = e - h * a.head_size;
    value_cache[((block * a.num_kv_heads + h) * a.head_size + d) * a.block_size + off] =
        scaled(v[e], a.inv_v, a.raw_v);
  }
}

void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache,
                            const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                            double k_scale, double v_scale, bool flash) {
  const char* op = flash ? "reshape_and_cache_flash" : "reshape_and_cache";
  const CacheWriteDims d = check_reshape_and_cache(key, value, key_cache, value_cache,
                                                   slot_mapping, kv_cache_dtype, k_scale,
                                                   v_scale, flash);
  TORCH_CHECK(key.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got key on ",
              key.device());
  const c10::cuda::CUDAGuard device_guard(key.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!stream_is_capturing(stream)) check_slot_mapping_values(d, slot_mapping);
  if (d.num_tokens == 0 || d.num_kv_heads == 0) return;
  TORCH_CHECK(d.num_tokens <= INT_MAX, op, ": ", d.num_tokens,
              " tokens are too many for one launch");

  const int64_t esize = key.element_size();
  CacheArgs a{};
  a.key_stride = d.key_stride;
  a.value_stride = d.value_stride;
  a.num_slots = d.num_blocks * d.block_size;
  a.num_kv_heads = static_cast<int>(d.num_kv_heads);
  a.head_size = static_cast<int>(d.head_size);
  a.block_size = static_cast<int>(d.block_size);
  a.inv_k = 1.0f / static_cast<float>(k_scale);
  a.inv_v = 1.0f / static_cast<float>(v_scale);
  a.raw_k = a.inv_k == 1.0f;
  a.raw_v = a.inv_v == 1.0f;
  a.vec_k = is_aligned16(key.data_ptr()) && (d.key_stride * esize) % 16 == 0 &&
            is_aligned16(key_cache.data_ptr());
  a.vec_v = is_aligned16(value.data_ptr()) && (d.value_stride * esize) % 16 == 0 &&
            is_aligned16(value_cache.data_ptr());

  const int64_t n = d.num_kv_heads * d.head_size;
  const int64_t work = flash ? n / d.x : n;  // per-thread items of the widest loop
  const int threads =
      static_cast<int>(std::min<int64_t>(kCacheThreads, std::max<int64_t>(32, (work + 31) / 32 * 32)));
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(key.scalar_type(), op, [&] {
    const auto* k = static_cast<const scalar_t*>(key.data_ptr());
    const auto* v = static_cast<const scalar_t*>(value.data_ptr());
    auto* kc = static_cast<scalar_t*>(key_cache.data_ptr());
    auto* vc = static_cast<scalar_t*>(value_cache.data_ptr());
    if (flash) {
      reshape_and_cache_kernel<scalar_t, true>
          <<<static_cast<unsigned>(d.num_tokens), threads, 0, stream>>>(k, v, kc, vc, slots, a);
    } else {
      reshape_and_cache_kernel<scalar_t, false>
          <<<static_cast<unsigned>(d.num_tokens), threads, 0, stream>>>(k, v, kc, vc, slots, a);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  // Metadata first (no device access), then the value check unless capturing a graph.
  int64_t num_blocks =
      check_copy_blocks(key_caches, value_caches, block_mapping, /*check_values=*/false);
  if (key_caches.empty()) return;
  TORCH_CHECK(key_caches[0].is_cuda(), "copy_blocks: the CUDA kernel needs CUDA caches, got ",
              key_caches[0].device());
  const c10::cuda::CUDAGuard device_guard(key_caches[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!stream_is_capturing(stream)) {
    num_blocks = check_copy_blocks(key_caches, value_caches, block_mapping, /*check_values=*/true);
  }
  const int64_t pairs = block_mapping.size(0);
  if (pairs == 0 || num_blocks == 0) return;
  TORCH_CHECK(pairs <= INT_MAX, "copy_blocks: ", pairs, " pairs are too many for one launch");

  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();
  for (int64_t l0 = 0; l0 < num_layers; l0 += kMaxCopyLayers) {
    const int64_t count = std::min<int64_t>(kMaxCopyLayers, num_layers - l0);
    CopyBlocksLayers layers{};
    bool vec = true;
    int64_t max_bytes = 0;
    for (int64_t i = 0; i < count; ++i) {
      const at::Tensor& k = key_caches[l0 + i];
      const at::Tensor& v = value_caches[l0 + i];
      layers.key[i] = reinterpret_cast<int64_t>(k.data_ptr());
      layers.value[i] = reinterpret_cast<int64_t>(v.data_ptr());
      layers.block_bytes[i] = k.numel() / num_blocks * k.element_size();
      vec = vec && is_aligned16(k.data_ptr()) && is_aligned16(v.data_ptr()) &&
            layers.block_bytes[i] % 16 == 0;
      max_bytes = std::max(max_bytes, layers.block_bytes[i]);
    }
    if (max_bytes == 0) continue;
    const int64_t units = vec ? max_bytes / 16 : max_bytes;
    const int threads = static_cast<int>(
        std::min<int64_t>(kCacheThreads, std::max<int64_t>(32, (units + 31) / 32 * 32)));
    const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(count));
    if (vec) {
      copy_blocks_kernel<uint4><<<grid, threads, 0, stream>>>(layers, mapping, num_blocks);
    } else {
      copy_blocks_kernel<unsigned char><<<grid, threads, 0, stream>>>(layers, mapping, num_blocks);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const int64_t block_bytes = check_swap_blocks(src, dst, block_mapping);
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()),
              "swap_blocks: src and dst must be on the CPU or a CUDA device, got ", src.device(),
              " and ", dst.device());
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(),
              "swap_blocks: the CUDA kernel needs src or dst on a CUDA device, got ",
              src.device(), " and ", dst.device());
  cudaMemcpyKind kind;
  at::Device device = src.device();
  if (src.is_cuda() && dst.is_cuda()) {
    TORCH_CHECK(src.device() == dst.device(), "swap_blocks: src is on ", src.device(),
                " but dst is on ", dst.device(), "; copies between two GPUs are not supported");
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda()) {
    kind = cudaMemcpyDeviceToHost;
  } else {
    kind = cudaMemcpyHostToDevice;
    device = dst.device();
  }
  const int64_t pairs = block_mapping.size(0);
  if (block_bytes == 0 || pairs == 0) return;
  const c10::cuda::CUDAGuard device_guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* dp = static_cast<char*>(dst.data_ptr());
  const int64_t* map = block_mapping.data_ptr<int64_t>();  // on the CPU, checked above
  for (int64_t i = 0; i < pairs; ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dp + map[2 * i + 1] * block_bytes, s + map[2 * i] * block_bytes,
                                   static_cast<size_t>(block_bytes), kind, stream));
  }
}

}  // namespace cuda
}  // namespace vllm_lite
