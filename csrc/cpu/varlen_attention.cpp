// CPU varlen_paged_attention: validation, the query tiles and their scheduling. The
// per-task kernel is varlen_attention_kernel.h, built once per ISA with the decode kernel
// (the build VLLM_LITE_CPU_ISA / set_cpu_isa selects runs both).
//
// Tasks are (query tile, KV head). Tiles differ in work (a tile sees its sequence's context
// up to its last query token), so they are handed out longest first, one at a time, to
// ATen's threads; each thread keeps one scratch buffer.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <numeric>

#include <ATen/Parallel.h>

#include "cpu/attention_params.h"
#include "cpu/cpu_isa.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

KvDType q_kv_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return KvDType::kFloat32;
    case at::kHalf: return KvDType::kFloat16;
    default: return KvDType::kBFloat16;  // validate.cpp allows no other query dtype
  }
}

void run_varlen_tasks(const VarlenParams& p) {
  const VarlenTaskFn fn = selected_varlen_task();
  const int64_t tasks = p.num_tiles * p.num_kv_heads;
  if (tasks == 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
  const int64_t floats = varlen_scratch_floats(p);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    std::unique_ptr<float, decltype(&std::free)> scratch(
        static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
    TORCH_CHECK(scratch != nullptr, "varlen_paged_attention: out of memory for ", bytes,
                " bytes of scratch");
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
        fn(p, t, scratch.get());
      }
    }
  });
}

}  // namespace

void varlen_paged_attention(at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            int64_t block_size, int64_t max_query_len, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const auto d = check_varlen_paged_attention(
      out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens, query_start_loc,
      block_size, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  check_varlen_paged_attention_values(d, block_tables, seq_lens, query_start_loc,
                                      max_query_len, max_seq_len);
  if (d.num_tokens == 0 || d.num_heads == 0) return;

  VarlenParams p{};
  p.q_dtype = q_kv_dtype(query.scalar_type());
  switch (d.cache_dtype) {
    case KvCacheDType::kAuto: p.cache_dtype = p.q_dtype; break;
    case KvCacheDType::kFp8E4M3: p.cache_dtype = KvDType::kFp8E4M3; break;
    case KvCacheDType::kFp8E5M2: p.cache_dtype = KvDType::kFp8E5M2; break;
  }
  p.query = query.data_ptr();
  p.q_stride_token = d.q_stride_seq;
  p.q_stride_head = d.q_stride_head;
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.flash_layout = d.flash_layout;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.num_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_size = d.head_size;
  p.block_size = d.block_size;
  p.max_blocks_per_seq = d.max_blocks_per_seq;
  p.scale = static_cast<float>(scale * k_scale);
  p.v_scale = static_cast<float>(v_scale);
  const int64_t group = d.num_heads / d.num_kv_heads;
  p.query_tile = std::max<int64_t>(1, kVarlenRows / group);

  // Tiles, and the context each sees (its sort key: the longest first).
  std::vector<int32_t> tile_seq, tile_start;
  std::vector<int64_t> tile_work;
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    const int64_t n = p.query_start_loc[s + 1] - p.query_start_loc[s];
    for (int64_t j = 0; j < n; j += p.query_tile) {
      tile_seq.push_back(static_cast<int32_t>(s));
      tile_start.push_back(static_cast<int32_t>(j));
      tile_work.push_back(p.seq_lens[s] - n + std::min(n, j + p.query_tile));
    }
  }
  std::vector<int64_t> order(tile_seq.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tile_work[a] > tile_work[b]; });
  std::vector<int32_t> seq_sorted(order.size()), start_sorted(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    seq_sorted[i] = tile_seq[order[i]];
    start_sorted[i] = tile_start[order[i]];
  }
  p.tile_seq = seq_sorted.data();
  p.tile_start = start_sorted.data();
  p.num_tiles = static_cast<int64_t>(order.size());

  // The kernel writes float32 or bfloat16 rows; float16 goes through a float32 copy, cast
  // once (writing bf16 directly saves a bf16 prefill the float32 rows and their cast).
  if (out.scalar_type() == at::kBFloat16) {
    p.out_bf16 = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    run_varlen_tasks(p);
    return;
  }
  const bool direct = out.scalar_type() == at::kFloat;
  const at::Tensor out_f32 = direct ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  p.out = out_f32.data_ptr<float>();
  run_varlen_tasks(p);
  if (!direct) out.copy_(out_f32);
}

}  // namespace vllm_lite::cpu
