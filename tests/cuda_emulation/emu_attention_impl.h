// Replays paged_attention_v1.cu / paged_attention_v2.cu's host code on the emulator.
// Included by one translation unit per dtype (emu_attention_<dtype>.cpp) and one per fp8
// cache format (emu_attention_fp8_<format>.cpp, all three query dtypes), so the kernel
// instantiations compile in parallel.
#pragma once

#include <algorithm>
#include <climits>

#include "cuda/attention/kernel_instances.cuh"
#include "emu_ops.h"
#include "emu_runtime.h"

namespace emu_ops {

namespace attn = vllm_lite::cuda::attn;

// launch_paged_attention (paged_attention_v1.cu); CT: the cache element.
template <typename T, typename CT>
void launch_attention(const AttentionArgs& d, void* out, float* exp_sums, float* max_logits,
                      int64_t num_partitions, int64_t grid_partitions, int64_t max_tokens) {
  if (d.num_seqs == 0 || d.num_heads == 0 || grid_partitions == 0) return;
  const int64_t group = d.num_heads / d.num_kv_heads;
  const attn::DecodeLaunch plan = attn::plan_decode_launch<T, CT>(
      static_cast<int>(d.cc), d.num_seqs, d.num_kv_heads, group, d.head_size,
      static_cast<int>(d.block_size), grid_partitions, d.sms);
  if (d.path_out != nullptr) *d.path_out = static_cast<int32_t>(plan.path);
  const attn::CtaSplit split = plan.split;
  const int64_t grid_x = d.num_seqs * d.num_kv_heads * split.ctas_per_kv_head;

  attn::AttentionParams p{};
  p.out = out;
  p.exp_sums = exp_sums;
  p.max_logits = max_logits;
  p.query = d.query;
  p.key_cache = d.key_cache;
  p.value_cache = d.value_cache;
  p.block_tables = d.block_tables;
  p.seq_lens = d.seq_lens;
  p.alibi_slopes = d.alibi_slopes;
  p.q_stride_seq = d.q_stride_seq;
  p.q_stride_head = d.q_stride_head;
  p.kv_block_stride = d.num_kv_heads * d.head_size * d.block_size;
  p.flash_layout = d.flash_layout;
  p.kv_token_stride = d.num_kv_heads * d.head_size;
  p.num_blocks = d.num_blocks;
  p.max_tokens = std::max<int64_t>(0, std::min<int64_t>(max_tokens, INT_MAX - attn::kChunkTokens));
  p.num_heads = static_cast<int>(d.num_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.head_size = static_cast<int>(d.head_size);
  p.group_size = static_cast<int>(group);
  p.heads_per_cta = static_cast<int>(split.heads_per_cta);
  p.ctas_per_kv_head = static_cast<int>(split.ctas_per_kv_head);
  p.max_blocks_per_seq = static_cast<int>(d.max_blocks_per_seq);
  p.num_partitions = static_cast<int>(num_partitions);
  p.partition_tokens = exp_sums != nullptr ? attn::kChunkTokens : INT_MAX;
  p.qk_scale = static_cast<float>(d.scale * d.k_scale);
  p.v_scale = static_cast<float>(d.v_scale);

  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_partitions));
  cuda_emu::launch(plan.kernel, grid, dim3(static_cast<unsigned>(plan.threads)), plan.smem,
                   plan.path == attn::DecodePath::kTensorCore ? "paged_attention_tc_kernel"
                                                              : "paged_attention_kernel",
                   p);
}

template <typename T, typename CT>
void paged_attention_v1(const AttentionArgs& d, void* out) {
  launch_attention<T, CT>(d, out, nullptr, nullptr, 1, 1, d.max_blocks_per_seq * d.block_size);
}

template <typename T, typename CT>
void paged_attention_v2(const AttentionArgs& d, void* out, float* exp_sums, float* max_logits,
                        void* tmp_out, int64_t num_partitions) {
  if (d.num_seqs * d.num_heads * d.head_size == 0) return;
  const int64_t grid_partitions = std::min<int64_t>(
      num_partitions, (d.max_seq_len + attn::kChunkTokens - 1) / attn::kChunkTokens);
  const int64_t max_tokens = std::min<int64_t>(d.max_blocks_per_seq * d.block_size,
                                               grid_partitions * attn::kChunkTokens);
  launch_attention<T, CT>(d, tmp_out, exp_sums, max_logits, num_partitions, grid_partitions,
                      max_tokens);
  attn::ReduceParams rp{};
  rp.out = out;
  rp.exp_sums = exp_sums;
  rp.max_logits = max_logits;
  rp.tmp_out = tmp_out;
  rp.seq_lens = d.seq_lens;
  rp.max_tokens = max_tokens;
  rp.num_heads = static_cast<int>(d.num_heads);
  rp.head_size = static_cast<int>(d.head_size);
  rp.num_partitions = static_cast<int>(num_partitions);
  cuda_emu::launch(&attn::paged_attention_v2_reduce_kernel<T>,
                   dim3(static_cast<unsigned>(d.num_seqs * d.num_heads)), dim3(attn::kThreads),
                   0, "paged_attention_v2_reduce_kernel", rp);
}

}  // namespace emu_ops

#define EMU_INSTANTIATE_ATTENTION(T, CT)                                                \
  template void paged_attention_v1<T, CT>(const AttentionArgs&, void*);                 \
  template void paged_attention_v2<T, CT>(const AttentionArgs&, void*, float*, float*,  \
                                          void*, int64_t);
