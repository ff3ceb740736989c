// The torch side of the CUDA cache ops (reshape_and_cache(_flash), copy_blocks,
// swap_blocks): the shared argument checks (validate.h, the CPU ops' messages), the
// CUDA-only ones, the device guard and the current stream; the kernels and their launchers
// are in cache_kernels.cu (grids, layouts and limits there). Content checks of slot
// mappings and copy_blocks pairs run only with VLLM_LITE_CHECK_VALUES=1 (a device sync
// each; see should_check_values in host_utils.h).
#include <climits>
#include <vector>

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cache_launch.h"
#include "cuda/host_utils.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {
namespace {

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

  cache::ReshapeAndCacheLaunch l{};
  l.dtype = to_float_type(key.scalar_type(), op);
  l.cache_dtype = d.cache_dtype;
  l.flash = flash;
  l.key = key.data_ptr();
  l.value = value.data_ptr();
  l.key_cache = key_cache.data_ptr();
  l.value_cache = value_cache.data_ptr();
  l.slot_mapping = slot_mapping.data_ptr<int64_t>();
  l.num_tokens = d.num_tokens;
  l.key_stride = d.key_stride;
  l.value_stride = d.value_stride;
  l.num_blocks = d.num_blocks;
  l.block_size = d.block_size;
  l.num_kv_heads = d.num_kv_heads;
  l.head_size = d.head_size;
  l.x = d.x;
  l.element_size = key.element_size();
  l.k_scale = k_scale;
  l.v_scale = v_scale;
  C10_CUDA_CHECK(cache::launch_reshape_and_cache(l, stream));
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

  const size_t num_layers = key_caches.size();
  std::vector<void*> keys(num_layers), values(num_layers);
  std::vector<int64_t> block_bytes(num_layers);
  for (size_t i = 0; i < num_layers; ++i) {
    keys[i] = key_caches[i].data_ptr();
    values[i] = value_caches[i].data_ptr();
    block_bytes[i] = key_caches[i].numel() / num_blocks * key_caches[i].element_size();
  }
  C10_CUDA_CHECK(cache::launch_copy_blocks(keys.data(), values.data(), block_bytes.data(),
                                           static_cast<int64_t>(num_layers),
                                           block_mapping.data_ptr<int64_t>(), pairs, num_blocks,
                                           stream));
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
  const bool merge_runs = cache::disjoint(s, src.size(0) * block_bytes, dp, dst.size(0) * block_bytes);
  cache::copy_mapped_blocks(s, dp, map, pairs, block_bytes, merge_runs,
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
