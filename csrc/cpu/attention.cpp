// CPU paged_attention_v1 / v2: validation, task scheduling and the cross-partition
// reduction. The per-task kernel lives in attention_kernel.h, built once per ISA.
//
// Both versions cut every sequence into 512-token partitions (more parallel tasks for few
// long sequences, bounded scratch), run one task per (sequence, KV head, partition) on
// ATen's thread pool with dynamic scheduling, then combine the partitions in float32.
// v1 keeps the per-partition results in internal scratch; v2 also writes them to the
// caller's exp_sums / max_logits / tmp_out as vLLM does.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu/attention_params.h"
#include "cpu/cpu_isa.h"
#include "cpu/packed_linear_params.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

struct IsaBuild {
  const char* name;
  AttentionTaskFn fn;
  VarlenTaskFn varlen;
};

// Linux hands out AMX's tile state only to a process that asks for it (else the first
// tile instruction raises SIGILL): asked once, process-wide, before the build is listed.
bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
#else
  return false;
#endif
}

bool cpu_supports(const char* name) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const std::string n(name);
  if (n == "amxbf16") {
    return cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
           __builtin_cpu_supports("amx-bf16") && packed_linear_bf16_amx() != nullptr &&
           amx_permitted();
  }
  if (n == "avx512bf16") {
    return cpu_supports("avx512") && __builtin_cpu_supports("avx512bf16");
  }
  if (n == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (n == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return std::string(name) == "generic";
}

const std::vector<IsaBuild>& available_builds() {
  static const std::vector<IsaBuild> builds = [] {
    std::vector<IsaBuild> all{
        {"amxbf16", attention_task_avx512bf16(), varlen_task_avx512bf16()},
        {"avx512bf16", attention_task_avx512bf16(), varlen_task_avx512bf16()},
        {"avx512", attention_task_avx512(), varlen_task_avx512()},
        {"avx2", attention_task_avx2(), varlen_task_avx2()},
        {"generic", attention_task_generic(), varlen_task_generic()}};
    std::vector<IsaBuild> ok;
    for (const auto& b : all) {
      if (b.fn != nullptr && cpu_supports(b.name)) ok.push_back(b);
    }
    return ok;
  }();
  return builds;
}

std::atomic<int> g_selected{-1};

int find_build(const std::string& name) {
  const auto& builds = available_builds();
  for (size_t i = 0; i < builds.size(); ++i) {
    if (name == builds[i].name) return static_cast<int>(i);
  }
  std::string have;
  for (const auto& b : builds) have += std::string(have.empty() ? "" : ", ") + b.name;
  TORCH_CHECK(false, "CPU ISA '", name, "' is not available on this CPU; available: ", have);
}

const IsaBuild& selected_build() {
  int i = g_selected.load(std::memory_order_relaxed);
  if (i < 0) {
    const char* env = std::getenv("VLLM_LITE_CPU_ISA");
    i = env != nullptr && *env != '\0' ? find_build(env) : 0;
    g_selected.store(i, std::memory_order_relaxed);
  }
  return available_builds()[i];
}

KvDType kv_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return KvDType::kFloat32;
    case at::kHalf: return KvDType::kFloat16;
    case at::kBFloat16: return KvDType::kBFloat16;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", t);
  }
}

int64_t cache_element_bytes(KvDType t) {
  switch (t) {
    case KvDType::kFloat32: return 4;
    case KvDType::kFloat16:
    case KvDType::kBFloat16: return 2;
    default: return 1;
  }
}

// How much of a task's K and of its V (each) is requested while the task before it runs.
// Inside a task the kernel keeps its next K tiles in flight, but it starts with none, and
// a decode step's tasks are short (a few hundred tokens: ~10 blocks). About a whole short
// task's worth ahead was the fastest setting with the caches flushed; a few blocks gained
// less, and more than this gained nothing (docs/results/comment_figures.md).
constexpr int64_t kTaskPrefetchBytes = 32 << 10;

// Requests the first kTaskPrefetchBytes of task t's K tiles and of its V tiles (into L2,
// as the kernel's own prefetches).
void prefetch_task(const AttentionParams& p, int64_t t) {
  const int64_t s = t / (p.num_partitions * p.num_kv_heads);
  const int64_t kh = (t / p.num_partitions) % p.num_kv_heads;
  const int64_t start = (t % p.num_partitions) * p.partition_size;
  const int64_t len = p.seq_lens[s];
  if (start >= len) return;
  const int64_t elem = cache_element_bytes(p.cache_dtype);
  const int64_t tile = p.head_size * p.block_size * elem;
  const int64_t block_stride = p.num_kv_heads * tile;
  const int64_t head_at = kv_head_offset(p.flash_layout, kh, p.head_size, p.block_size) * elem;
  const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
  const int64_t first = start / p.block_size;
  const int64_t last = std::min(len - 1, start + p.partition_size - 1) / p.block_size;
  const int64_t blocks = std::max<int64_t>(1, kTaskPrefetchBytes / tile);
  for (int64_t b = first; b <= last && b < first + blocks; ++b) {
    const int64_t at = table[b] * block_stride + head_at;
    for (const void* base : {p.key_cache, p.value_cache}) {
      prefetch_kv_tile(static_cast<const char*>(base) + at, p.flash_layout, p.head_size,
                       p.block_size, p.num_kv_heads, elem);
    }
  }
}

// Runs every (sequence, KV head, partition) task; results land in p.part_*.
void run_tasks(const AttentionParams& p) {
  const AttentionTaskFn fn = selected_build().fn;
  const int64_t tasks = p.num_seqs * p.num_kv_heads * p.num_partitions;
  const int64_t scratch_floats = attention_scratch_floats(p);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
  if (tasks == 0) return;
  // Sequences differ in length, so hand out tasks one at a time instead of in fixed
  // ranges; each worker keeps one scratch buffer.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // 64-byte aligned: the kernel keeps whole vectors in it.
    const size_t bytes = (scratch_floats * sizeof(float) + 63) / 64 * 64;
    std::unique_ptr<float, decltype(&std::free)> scratch(
        static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
    TORCH_CHECK(scratch != nullptr, "paged_attention: out of memory for ", bytes, " bytes of scratch");
    for (int64_t w = begin; w < end; ++w) {
      // Each worker claims its next task before running the current one, so that task's
      // first tiles arrive meanwhile.
      int64_t t = next.fetch_add(1);
      while (t < tasks) {
        const int64_t after = next.fetch_add(1);
        if (after < tasks) prefetch_task(p, after);
        fn(p, t, scratch.get());
        t = after;
      }
    }
  });
}

// out[s, h] (and tmp_out, when given) from the per-partition results in float32.
template <typename T>
void combine_partitions(const AttentionParams& p, T* out, T* tmp_out) {
  const int64_t D = p.head_size, P = p.num_partitions;
  at::parallel_for(0, p.num_seqs * p.num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(P);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t len = p.seq_lens[sh / p.num_heads];
      const int64_t parts = (len + p.partition_size - 1) / p.partition_size;
      T* o = out + sh * D;
      const float* po = p.part_out + sh * P * D;
      if (parts == 0) {
        std::fill(o, o + D, static_cast<T>(0.0f));
        continue;
      }
      const float* pm = p.part_max + sh * P;
      const float* ps = p.part_sum + sh * P;
      const float m = *std::max_element(pm, pm + parts);
      float total = 0.0f;
      for (int64_t i = 0; i < parts; ++i) {
        weights[i] = ps[i] * std::exp(pm[i] - m);
        total += weights[i];
      }
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < parts; ++i) acc += weights[i] * po[i * D + d];
        o[d] = static_cast<T>(acc / total);
      }
      if (tmp_out != nullptr) {
        T* to = tmp_out + sh * P * D;
        for (int64_t i = 0; i < parts * D; ++i) to[i] = static_cast<T>(po[i]);
      }
    }
  });
}

AttentionParams make_params(const PagedAttentionDims& d, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens,
                            const std::optional<at::Tensor>& alibi_slopes, double k_scale,
                            double v_scale, int64_t num_partitions) {
  AttentionParams p{};
  p.q_dtype = kv_dtype(query.scalar_type());
  switch (d.cache_dtype) {
    case KvCacheDType::kAuto: p.cache_dtype = p.q_dtype; break;
    case KvCacheDType::kFp8E4M3: p.cache_dtype = KvDType::kFp8E4M3; break;
    case KvCacheDType::kFp8E5M2: p.cache_dtype = KvDType::kFp8E5M2; break;
  }
  p.query = query.data_ptr();
  p.q_stride_seq = d.q_stride_seq;
  p.q_stride_head = d.q_stride_head;
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.flash_layout = d.flash_layout;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.num_seqs = d.num_seqs;
  p.num_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_size = d.head_size;
  p.block_size = d.block_size;
  p.max_blocks_per_seq = d.max_blocks_per_seq;
  p.scale = static_cast<float>(scale * k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.partition_size = kPartitionSize;
  p.num_partitions = num_partitions;
  return p;
}

void attention(const PagedAttentionDims& d, at::Tensor& out, AttentionParams& p,
               at::Tensor* tmp_out) {
  const auto opts = out.options().dtype(at::kFloat);
  const at::Tensor part_out = at::empty({d.num_seqs, d.num_heads, p.num_partitions, d.head_size}, opts);
  p.part_out = part_out.data_ptr<float>();
  run_tasks(p);
  if (p.num_partitions == 1 && tmp_out == nullptr) {
    // One partition (every sequence <= kPartitionSize tokens, v1): each task wrote the
    // finished, normalized output, so only its dtype changes (ATen's vectorized copy),
    // which costs less than combine_partitions' scalar per-element loop.
    out.copy_(part_out.view(out.sizes()));
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      if (p.seq_lens[s] == 0) out[s].zero_();  // no task ran: part_out is garbage there
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "paged_attention", [&] {
    combine_partitions<scalar_t>(p, out.data_ptr<scalar_t>(),
                                 tmp_out != nullptr ? tmp_out->data_ptr<scalar_t>() : nullptr);
  });
}

}  // namespace

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (const auto& b : available_builds()) names.emplace_back(b.name);
  return names;
}

std::string cpu_isa() { return selected_build().name; }

VarlenTaskFn selected_varlen_task() { return selected_build().varlen; }

void set_cpu_isa(const std::string& name) {
  g_selected.store(find_build(name), std::memory_order_relaxed);
}

bool cpu_isa_includes(const std::string& name) {
  // Widest first; each x86 build implies those after it (cpu_isa.h).
  static const char* const kOrder[] = {"amxbf16", "avx512bf16", "avx512", "avx2", "generic"};
  const std::string selected = cpu_isa();
  bool reached = false;
  for (const char* n : kOrder) {
    reached = reached || selected == n;
    if (name == n) return reached;
  }
  return false;
}

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const auto d = check_paged_attention(out, query, key_cache, value_cache, num_kv_heads,
                                       block_tables, seq_lens, block_size, max_seq_len,
                                       alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  check_paged_attention_values(d, block_tables, seq_lens, max_seq_len);
  const int64_t parts = std::max<int64_t>(1, (max_seq_len + kPartitionSize - 1) / kPartitionSize);
  auto p = make_params(d, query, key_cache, value_cache, scale, block_tables, seq_lens,
                       alibi_slopes, k_scale, v_scale, parts);
  const auto stats = at::empty({2, d.num_seqs, d.num_heads, parts}, out.options().dtype(at::kFloat));
  p.part_max = stats[0].data_ptr<float>();
  p.part_sum = stats[1].data_ptr<float>();
  attention(d, out, p, nullptr);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  const auto d = check_paged_attention(out, query, key_cache, value_cache, num_kv_heads,
                                       block_tables, seq_lens, block_size, max_seq_len,
                                       alibi_slopes, kv_cache_dtype, k_scale, v_scale);
  const int64_t parts =
      check_paged_attention_v2_scratch(d, out, exp_sums, max_logits, tmp_out, max_seq_len);
  check_paged_attention_values(d, block_tables, seq_lens, max_seq_len);
  auto p = make_params(d, query, key_cache, value_cache, scale, block_tables, seq_lens,
                       alibi_slopes, k_scale, v_scale, parts);
  p.part_max = max_logits.data_ptr<float>();
  p.part_sum = exp_sums.data_ptr<float>();
  attention(d, out, p, &tmp_out);
}

}  // namespace vllm_lite::cpu
