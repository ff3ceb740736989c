// CUDA cache ops: reshape_and_cache (+ flash layout), copy_blocks, swap_blocks.
//
// Content checks of slot mappings and copy_blocks pairs run only with
// VLLM_LITE_CHECK_VALUES=1 (a device sync each; see should_check_values in cuda_utils.cuh).
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
#include <climits>

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cache_kernels.cuh"
#include "cuda/cuda_utils.cuh"
#include "cuda/dtype.cuh"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace {

using namespace cache;

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
  if (should_check_values(stream)) check_slot_mapping_values(d, slot_mapping);
  if (d.num_tokens == 0 || d.num_kv_heads == 0) return;
  TORCH_CHECK(d.num_tokens <= INT_MAX, op, ": ", d.num_tokens,
              " tokens are too many for one launch");

  const CacheArgs a = make_cache_args(
      d.key_stride, d.value_stride, d.num_blocks, d.block_size, d.num_kv_heads, d.head_size,
      key.element_size(), k_scale, v_scale, key.data_ptr(), value.data_ptr(),
      key_cache.data_ptr(), value_cache.data_ptr());
  const int64_t n = d.num_kv_heads * d.head_size;
  // Items of the widest loop (an fp8 flash row is converted element by element).
  const bool fp8 = d.cache_dtype != KvCacheDType::kAuto;
  const int threads = cache_threads(flash && !fp8 ? n / d.x : n);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  VLLM_LITE_CUDA_DISPATCH_FLOAT_TYPES(key.scalar_type(), op, [&] {
    dispatch_cache_elem<scalar_t>(d.cache_dtype, [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      const auto* k = static_cast<const scalar_t*>(key.data_ptr());
      const auto* v = static_cast<const scalar_t*>(value.data_ptr());
      auto* kc = static_cast<cache_t*>(key_cache.data_ptr());
      auto* vc = static_cast<cache_t*>(value_cache.data_ptr());
      const unsigned grid = static_cast<unsigned>(d.num_tokens);
      if (flash) {
        reshape_and_cache_kernel<scalar_t, cache_t, true>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, slots, a);
      } else {
        reshape_and_cache_kernel<scalar_t, cache_t, false>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, slots, a);
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  // Metadata first (no device access), then the value check when enabled (a device sync;
  // see should_check_values).
  int64_t num_blocks =
      check_copy_blocks(key_caches, value_caches, block_mapping, /*check_values=*/false);
  if (key_caches.empty()) return;
  TORCH_CHECK(key_caches[0].is_cuda(), "copy_blocks: the CUDA kernel needs CUDA caches, got ",
              key_caches[0].device());
  const c10::cuda::CUDAGuard device_guard(key_caches[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (should_check_values(stream)) {
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
    const int threads = cache_threads(units);
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
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* dp = static_cast<char*>(dst.data_ptr());
  const int64_t* map = block_mapping.data_ptr<int64_t>();  // on the CPU, checked above
  const bool merge_runs = disjoint(s, src.size(0) * block_bytes, dp, dst.size(0) * block_bytes);
  copy_mapped_blocks(s, dp, map, pairs, block_bytes, merge_runs,
                     [&](char* to, const char* from, size_t n) {
                       C10_CUDA_CHECK(cudaMemcpyAsync(to, from, n, kind, stream.stream()));
                     });
  if (kind != cudaMemcpyDeviceToDevice) {
    // The copies run after this returns. A pinned tensor from torch's caching host
    // allocator (pin_memory(), e.g. a temporary) goes back to the allocator's pool when
    // freed; recording the stream keeps that memory from being handed out again until the
    // copies are done. Memory the allocator does not own (pageable, or pinned elsewhere)
    // is not tracked: record_event returns false, and a pageable copy is synchronous for
    // the host side anyway.
    const at::Tensor& host = src.is_cpu() ? src : dst;
    const c10::DataPtr& data = host.storage().data_ptr();
    at::getHostAllocator(at::kCUDA)->record_event(data.get(), data.get_context(),
                                                  stream.unwrap());
  }
}

}  // namespace cuda
}  // namespace vllm_lite
