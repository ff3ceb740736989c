// The torch side of the CUDA attention ops: the shared argument checks (validate.h, the
// CPU ops' messages), the CUDA-only ones, the device guard and the current stream; the
// launchers they call hold no torch code (see launch_types.h).
//   paged_attention_v1, v2 -> attn::launch_paged_attention (paged_attention_v1.cu), and
//                             v2's attn::launch_paged_attention_v2_reduce (paged_attention_v2.cu)
//   varlen_paged_attention -> varlen::launch_varlen_paged_attention (varlen_attention.cu)
#include <algorithm>
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/attention/attention_launch.h"
#include "cuda/attention/varlen_launch.h"
#include "cuda/host_utils.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite {
namespace cuda {

namespace {

// The launch arguments every paged-attention call shares, from its checked dims and
// tensors, for the current device.
attn::PagedKvArgs paged_kv_args(const char* op, const PagedAttentionDims& d,
                                const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens,
                                const std::optional<at::Tensor>& alibi_slopes, double scale,
                                double k_scale, double v_scale) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  attn::PagedKvArgs kv{};
  kv.dtype = to_float_type(query.scalar_type(), op);
  kv.cache_dtype = d.cache_dtype;
  kv.cc = props->major * 10 + props->minor;
  kv.query = query.data_ptr();
  kv.key_cache = key_cache.data_ptr();
  kv.value_cache = value_cache.data_ptr();
  kv.block_tables = block_tables.data_ptr<int32_t>();
  kv.seq_lens = seq_lens.data_ptr<int32_t>();
  kv.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  kv.num_seqs = d.num_seqs;
  kv.num_heads = d.num_heads;
  kv.num_kv_heads = d.num_kv_heads;
  kv.head_size = d.head_size;
  kv.block_size = d.block_size;
  kv.num_blocks = d.num_blocks;
  kv.max_blocks_per_seq = d.max_blocks_per_seq;
  kv.q_stride_seq = d.q_stride_seq;
  kv.q_stride_head = d.q_stride_head;
  kv.flash_layout = d.flash_layout;
  kv.scale = scale;
  kv.k_scale = k_scale;
  kv.v_scale = v_scale;
  return kv;
}

// One call of paged_attention_v1 or v2 on CUDA: the prologue both run (every argument
// check, v2's scratch shapes, the CUDA-only checks, the device guard, the stream, the
// content checks) and the attention kernel's launch they share. It keeps references to
// the caller's tensors, so it lives only for the entry point's call.
class PagedAttentionCall {
 public:
  // op names the entry point in messages. v1 passes nullptr for the three scratch tensors;
  // v2 passes all three.
  PagedAttentionCall(const char* op, const at::Tensor& out, const at::Tensor* exp_sums,
                     const at::Tensor* max_logits, const at::Tensor* tmp_out,
                     const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     int64_t block_size, int64_t max_seq_len,
                     const std::optional<at::Tensor>& alibi_slopes,
                     const std::string& kv_cache_dtype, double k_scale, double v_scale)
      : query_(query),
        key_cache_(key_cache),
        value_cache_(value_cache),
        block_tables_(block_tables),
        seq_lens_(seq_lens),
        alibi_slopes_(alibi_slopes),
        scale_(scale),
        k_scale_(k_scale),
        v_scale_(v_scale),
        d_(check_paged_attention(out, query, key_cache, value_cache, num_kv_heads,
                                 block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                                 kv_cache_dtype, k_scale, v_scale)),
        num_partitions_(exp_sums == nullptr
                            ? 1
                            : check_paged_attention_v2_scratch(d_, out, *exp_sums, *max_logits,
                                                               *tmp_out, max_seq_len)) {
    TORCH_CHECK(query.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got query on ",
                query.device());
    TORCH_CHECK(attn::cuda_block_size_supported(block_size), "paged_attention: block_size ",
                block_size, " is not supported on CUDA; use 8, 16 or 32");
    TORCH_CHECK(!d_.flash_layout || d_.head_size % d_.x == 0, op, ": head_size ",
                d_.head_size, " must be a multiple of ", d_.x,
                " for a flash-layout cache of 16-byte chunks on CUDA (kv_cache_dtype '",
                kv_cache_dtype, "')");
    device_guard_.set_device(query.device());
    stream_ = at::cuda::getCurrentCUDAStream();
    if (should_check_values(stream_)) {
      check_paged_attention_values(d_, block_tables, seq_lens, max_seq_len);
    }
  }

  const PagedAttentionDims& dims() const { return d_; }
  // P of v2's scratch; 1 for v1.
  int64_t num_partitions() const { return num_partitions_; }
  cudaStream_t stream() const { return stream_; }

  // Launches the attention kernel on stream() (see attn::DecodeLaunchArgs for the v1 / v2
  // arguments).
  void launch(void* out, float* exp_sums, float* max_logits, int64_t num_partitions,
              int64_t grid_partitions, int64_t max_tokens) const {
    const PagedAttentionDims& d = d_;
    if (d.num_seqs == 0 || d.num_heads == 0 || grid_partitions == 0) return;
    TORCH_CHECK(is_aligned16(key_cache_.data_ptr()) && is_aligned16(value_cache_.data_ptr()),
                "paged_attention: key_cache and value_cache must start at 16-byte aligned "
                "addresses on CUDA");
    attn::DecodeLaunchArgs a{};
    a.kv = paged_kv_args("paged_attention", d, query_, key_cache_, value_cache_, block_tables_,
                         seq_lens_, alibi_slopes_, scale_, k_scale_, v_scale_);
    a.sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    a.out = out;
    a.exp_sums = exp_sums;
    a.max_logits = max_logits;
    a.num_partitions = num_partitions;
    a.grid_partitions = grid_partitions;
    a.max_tokens = max_tokens;
    C10_CUDA_CHECK(attn::launch_paged_attention(a, stream_));
  }

 private:
  const at::Tensor& query_;
  const at::Tensor& key_cache_;
  const at::Tensor& value_cache_;
  const at::Tensor& block_tables_;
  const at::Tensor& seq_lens_;
  const std::optional<at::Tensor>& alibi_slopes_;
  double scale_, k_scale_, v_scale_;
  PagedAttentionDims d_;
  int64_t num_partitions_;
  c10::cuda::OptionalCUDAGuard device_guard_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const PagedAttentionCall call("paged_attention", out, nullptr, nullptr, nullptr, query,
                                key_cache, value_cache, num_kv_heads, scale, block_tables,
                                seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                                k_scale, v_scale);
  call.launch(out.data_ptr(), nullptr, nullptr, /*num_partitions=*/1, /*grid_partitions=*/1,
              /*max_tokens=*/call.dims().max_blocks_per_seq * block_size);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const PagedAttentionCall call("paged_attention_v2", out, &exp_sums, &max_logits, &tmp_out,
                                query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                                k_scale, v_scale);
  const PagedAttentionDims& d = call.dims();
  const int64_t num_partitions = call.num_partitions();
  if (out.numel() == 0) return;
  TORCH_CHECK(num_partitions <= INT_MAX, "paged_attention_v2: ", num_partitions,
              " partitions are too many");

  // Only the partitions max_seq_len can reach are launched; lengths are clamped to them
  // (and to the block table) in both kernels, so unvalidated lengths stay in bounds.
  const int64_t grid_partitions = std::min(num_partitions, ceil_div(max_seq_len, kPartitionSize));
  const int64_t max_tokens =
      std::min(d.max_blocks_per_seq * block_size, grid_partitions * kPartitionSize);
  call.launch(tmp_out.data_ptr(), exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(),
              num_partitions, grid_partitions, max_tokens);
  C10_CUDA_CHECK(attn::launch_paged_attention_v2_reduce(
      to_float_type(query.scalar_type(), "paged_attention_v2"), out.data_ptr(),
      exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(), tmp_out.data_ptr(),
      seq_lens.data_ptr<int32_t>(), max_tokens, d.num_seqs, d.num_heads, d.head_size,
      num_partitions, call.stream()));
}

void varlen_paged_attention(at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            int64_t block_size, int64_t max_query_len, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  constexpr const char* op = "varlen_paged_attention";
  const PagedAttentionDims d = check_varlen_paged_attention(
      out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, query_start_loc,
      block_size, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  TORCH_CHECK(query.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got query on ",
              query.device());
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, op, ": block_size ",
              block_size, " is not supported on CUDA; use 8, 16 or 32");
  TORCH_CHECK(!d.flash_layout || d.head_size % d.x == 0, op, ": head_size ", d.head_size,
              " must be a multiple of ", d.x, " for a flash-layout cache of 16-byte chunks "
              "on CUDA (kv_cache_dtype '", kv_cache_dtype, "')");
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (should_check_values(stream)) {
    check_varlen_paged_attention_values(d, block_tables, seq_lens, query_start_loc,
                                        max_query_len, max_seq_len);
  }
  if (d.num_tokens == 0 || d.num_heads == 0 || d.num_seqs == 0 || max_query_len == 0) return;
  TORCH_CHECK(is_aligned16(key_cache.data_ptr()) && is_aligned16(value_cache.data_ptr()), op,
              ": key_cache and value_cache must start at 16-byte aligned addresses on CUDA");

  varlen::VarlenLaunchArgs a{};
  a.kv = paged_kv_args(op, d, query, key_cache, value_cache, block_tables, seq_lens,
                       alibi_slopes, scale, k_scale, v_scale);
  a.out = out.data_ptr();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.num_tokens = d.num_tokens;
  a.max_query_len = max_query_len;
  C10_CUDA_CHECK(varlen::launch_varlen_paged_attention(a, stream));
}

}  // namespace cuda
}  // namespace vllm_lite
