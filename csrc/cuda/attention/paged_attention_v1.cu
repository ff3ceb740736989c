// Paged attention's CUDA launch, shared by v1 and v2 (attention_ops.cpp calls it): the
// kernel (SIMT or tensor-core, as plan_decode_launch / attention_path.h choose; the
// kernels' instances are compiled in the files csrc/cuda/generate_kernels.py writes, and
// found here through its table; see attention_kernels.cuh for the design), its CTA split,
// grid and launch. v1 runs one CTA per (sequence, kv head[, head group]) over the whole
// sequence with an online softmax in 512-token chunks, so it has no sequence-length limit
// and needs no scratch. Caches in the query dtype or fp8 (kv_cache_dtype "fp8" /
// "fp8_e4m3" / "fp8_e5m2"; the kernels are instantiated per (query dtype, cache element)).
// No torch header (see launch_types.h).
#include <algorithm>
#include <climits>

#include <cuda_runtime.h>

#include "cuda/attention/attention_kernels.cuh"
#include "cuda/attention/attention_launch.h"
#include "cuda/dtype.cuh"

namespace vllm_lite {
namespace cuda {
namespace attn {

cudaError_t launch_paged_attention(const DecodeLaunchArgs& a, cudaStream_t stream) {
  const PagedKvArgs& kv = a.kv;
  const int64_t group = kv.num_heads / kv.num_kv_heads;
  // The kernel (SIMT or tensor cores: attention_path.h), its CTA split and block.
  DecodeLaunch plan{};
  dispatch_float_type(kv.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_elem<scalar_t>(kv.cache_dtype, [&](auto cache_tag) {
      plan = plan_decode_launch<scalar_t, decltype(cache_tag)>(
          kv.cc, kv.num_seqs, kv.num_kv_heads, group, kv.head_size,
          static_cast<int>(kv.block_size), a.grid_partitions, a.sms);
    });
  });
  const int64_t ctas = plan.split.ctas_per_kv_head;
  const int64_t hpc = plan.split.heads_per_cta;

  const int64_t grid_x = kv.num_seqs * kv.num_kv_heads * ctas;
  TORCH_CHECK(grid_x <= INT_MAX, "paged_attention: too many sequences for one launch (",
              kv.num_seqs, " sequences x ", kv.num_kv_heads * ctas, " CTAs each)");
  TORCH_CHECK(a.grid_partitions <= 65535, "paged_attention: ", a.grid_partitions,
              " partitions of ", kChunkTokens, " tokens exceed the CUDA grid limit of 65535");

  AttentionParams p{};
  p.out = a.out;
  p.exp_sums = a.exp_sums;
  p.max_logits = a.max_logits;
  p.query = kv.query;
  p.key_cache = kv.key_cache;
  p.value_cache = kv.value_cache;
  p.block_tables = kv.block_tables;
  p.seq_lens = kv.seq_lens;
  p.alibi_slopes = kv.alibi_slopes;
  p.q_stride_seq = kv.q_stride_seq;
  p.q_stride_head = kv.q_stride_head;
  p.kv_block_stride = kv.num_kv_heads * kv.head_size * kv.block_size;
  p.flash_layout = kv.flash_layout;
  p.kv_token_stride = kv.num_kv_heads * kv.head_size;
  p.num_blocks = kv.num_blocks;
  p.max_tokens = std::max<int64_t>(0, std::min<int64_t>(a.max_tokens, INT_MAX - kChunkTokens));
  p.num_heads = static_cast<int>(kv.num_heads);
  p.num_kv_heads = static_cast<int>(kv.num_kv_heads);
  p.head_size = static_cast<int>(kv.head_size);
  p.group_size = static_cast<int>(group);
  p.heads_per_cta = static_cast<int>(hpc);
  p.ctas_per_kv_head = static_cast<int>(ctas);
  p.max_blocks_per_seq = static_cast<int>(kv.max_blocks_per_seq);
  p.num_partitions = static_cast<int>(a.num_partitions);
  p.partition_tokens = a.exp_sums != nullptr ? kChunkTokens : INT_MAX;
  p.qk_scale = static_cast<float>(kv.scale * kv.k_scale);
  p.v_scale = static_cast<float>(kv.v_scale);

  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(a.grid_partitions));
  plan.kernel<<<grid, plan.threads, plan.smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
