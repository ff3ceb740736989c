#include "validate.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "attention_limits.h"
#include "moe_limits.h"

namespace vllm_lite {
namespace {

// Messages name the op, the argument and what was wrong with it, e.g.
// "paged_attention: key_cache must be contiguous (shape [8, 2, 8, 16, 8], strides ...)".
void check_same_device(const char* op, const at::Tensor& t, const char* name,
                       const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device(), "; all tensors must be on one device");
}

void check_dtype(const char* op, const at::Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ",
              t.scalar_type());
}

void check_dim(const char* op, const at::Tensor& t, const char* name, int64_t dim,
               const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", layout, ", got shape ",
              t.sizes());
}

void check_contiguous(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t.sizes(),
              " with strides ", t.strides());
}

KvCacheDType check_kv_cache_dtype(const char* op, const std::string& kv_cache_dtype,
                                  double k_scale, double v_scale) {
  KvCacheDType kind;
  if (kv_cache_dtype == "auto") {
    kind = KvCacheDType::kAuto;
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    kind = KvCacheDType::kFp8E4M3;
  } else if (kv_cache_dtype == "fp8_e5m2") {
    kind = KvCacheDType::kFp8E5M2;
  } else {
    TORCH_CHECK(false, op, ": kv_cache_dtype '", kv_cache_dtype, "' is not supported; use "
                "'auto' (the cache holds the model dtype), 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2'");
  }
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              op, ": k_scale and v_scale must be finite and positive, got ", k_scale, " and ",
              v_scale);
  return kind;
}

// The caches hold the model dtype (`model`, kv_cache_dtype "auto") or fp8 bytes (uint8).
void check_cache_dtype(const char* op, const at::Tensor& t, const char* name,
                       at::ScalarType model, KvCacheDType kind) {
  if (kind == KvCacheDType::kAuto) {
    TORCH_CHECK(t.scalar_type() == model, op, ": ", name, " must be ", model,
                " for kv_cache_dtype 'auto', got ", t.scalar_type(),
                t.scalar_type() == at::kByte ? " (a uint8 cache holds fp8: pass kv_cache_dtype "
                                               "'fp8', 'fp8_e4m3' or 'fp8_e5m2')"
                                             : "");
  } else {
    TORCH_CHECK(t.scalar_type() == at::kByte, op, ": ", name,
                " must be uint8 (Byte) for an fp8 kv_cache_dtype, as in vLLM, got ",
                t.scalar_type());
  }
}

// The paged key cache splits head_size into chunks of x elements (16 bytes): an fp8 cache
// (x = 16) needs head_size to be a multiple of 16, as in vLLM.
void check_head_size_fits_x(const char* op, int64_t head_size, int64_t x,
                            const std::string& kv_cache_dtype) {
  TORCH_CHECK(head_size % x == 0, op, ": head_size ", head_size, " must be a multiple of ", x,
              " (the key cache's 16-byte chunk) for kv_cache_dtype '", kv_cache_dtype, "'");
}

// Elements per 16-byte chunk of the paged key cache.
int64_t key_chunk_elems(at::ScalarType model, KvCacheDType kind) {
  return kind == KvCacheDType::kAuto ? 16 / static_cast<int64_t>(c10::elementSize(model)) : 16;
}

void check_float_dtype(const char* op, const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", s);
}

void check_head_size(const char* op, int64_t head_size) {
  TORCH_CHECK(head_size > 0 && head_size % 8 == 0 && head_size <= kMaxHeadSize, op,
              ": head_size must be a multiple of 8 in [8, ", kMaxHeadSize, "], got ", head_size);
}

// True when the tensor's values can be read without a device round trip.
bool on_cpu(const at::Tensor& t) { return t.device().is_cpu(); }

}  // namespace

namespace {

// paged_attention (one query row per sequence: num_seqs = query rows) and
// varlen_paged_attention (query rows flat over sequences: num_seqs = seq_lens entries).
PagedAttentionDims check_attention_common(
    const char* op, const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
    const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
    double k_scale, double v_scale, bool varlen) {
  const KvCacheDType kind = check_kv_cache_dtype(op, kv_cache_dtype, k_scale, v_scale);

  check_dim(op, query, "query", 3,
            varlen ? "[num_tokens, num_heads, head_size]" : "[num_seqs, num_heads, head_size]");
  check_float_dtype(op, query, "query");
  PagedAttentionDims d{};
  d.num_tokens = query.size(0);
  check_dim(op, seq_lens, "seq_lens", 1, "[num_seqs]");
  d.num_seqs = varlen ? seq_lens.size(0) : query.size(0);
  d.num_heads = query.size(1);
  d.head_size = query.size(2);
  check_head_size(op, d.head_size);
  TORCH_CHECK(query.stride(2) == 1, op, ": query's last dimension must be contiguous, got strides ",
              query.strides());
  d.q_stride_seq = query.stride(0);
  d.q_stride_head = query.stride(1);

  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have query's shape ", query.sizes(),
              ", got ", out.sizes());
  check_dtype(op, out, "out", query.scalar_type());
  check_contiguous(op, out, "out");

  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{out, "out"},
                                {key_cache, "key_cache"},
                                {value_cache, "value_cache"},
                                {block_tables, "block_tables"},
                                {seq_lens, "seq_lens"}}) {
    check_same_device(op, t, name, query, "query");
  }

  d.cache_dtype = kind;
  d.x = key_chunk_elems(query.scalar_type(), kind);
  TORCH_CHECK(key_cache.dim() == 5 || key_cache.dim() == 4, op,
              ": key_cache must be 5-D [num_blocks, num_kv_heads, head_size / x, block_size, x] "
              "(split layout) or 4-D [num_blocks, block_size, num_kv_heads, head_size] (flash "
              "layout), got ", key_cache.dim(), "-D shape ", key_cache.sizes());
  d.flash_layout = key_cache.dim() == 4;
  if (!d.flash_layout) check_head_size_fits_x(op, d.head_size, d.x, kv_cache_dtype);
  check_dim(op, value_cache, "value_cache", 4,
            d.flash_layout ? "[num_blocks, block_size, num_kv_heads, head_size] (the flash "
                             "layout, as key_cache)"
                           : "[num_blocks, num_kv_heads, head_size, block_size]");
  check_cache_dtype(op, key_cache, "key_cache", query.scalar_type(), kind);
  check_cache_dtype(op, value_cache, "value_cache", query.scalar_type(), kind);
  check_contiguous(op, key_cache, "key_cache");
  check_contiguous(op, value_cache, "value_cache");

  TORCH_CHECK(num_kv_heads > 0, op, ": num_kv_heads must be positive, got ", num_kv_heads);
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
  d.num_kv_heads = num_kv_heads;
  d.block_size = block_size;
  d.num_blocks = key_cache.size(0);
  if (d.flash_layout) {
    const std::vector<int64_t> want{d.num_blocks, block_size, num_kv_heads, d.head_size};
    TORCH_CHECK(key_cache.sizes() == at::IntArrayRef(want), op, ": key_cache must have shape ",
                at::IntArrayRef(want), " (flash layout) for num_kv_heads=", num_kv_heads,
                ", head_size=", d.head_size, ", block_size=", block_size, ", got ",
                key_cache.sizes());
    TORCH_CHECK(value_cache.sizes() == at::IntArrayRef(want), op,
                ": value_cache must have key_cache's shape ", at::IntArrayRef(want),
                " (flash layout), got ", value_cache.sizes());
  } else {
    const std::vector<int64_t> want_k{d.num_blocks, num_kv_heads, d.head_size / d.x, block_size,
                                      d.x};
    TORCH_CHECK(key_cache.sizes() == at::IntArrayRef(want_k), op, ": key_cache must have shape ",
                at::IntArrayRef(want_k), " for num_kv_heads=", num_kv_heads,
                ", head_size=", d.head_size, ", block_size=", block_size, ", x=", d.x, ", got ",
                key_cache.sizes());
    const std::vector<int64_t> want_v{d.num_blocks, num_kv_heads, d.head_size, block_size};
    TORCH_CHECK(value_cache.sizes() == at::IntArrayRef(want_v), op,
                ": value_cache must have shape ", at::IntArrayRef(want_v), ", got ",
                value_cache.sizes());
  }

  TORCH_CHECK(d.num_heads % num_kv_heads == 0, op, ": num_heads (", d.num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(d.num_heads / num_kv_heads <= kMaxQueryHeadsPerKvHead, op, ": at most ",
              kMaxQueryHeadsPerKvHead, " query heads per KV head are supported, got ",
              d.num_heads / num_kv_heads);

  check_dim(op, block_tables, "block_tables", 2, "[num_seqs, max_blocks_per_seq]");
  check_dtype(op, block_tables, "block_tables", at::kInt);
  check_contiguous(op, block_tables, "block_tables");
  TORCH_CHECK(block_tables.size(0) == d.num_seqs, op, ": block_tables has ",
              block_tables.size(0), " rows but ", varlen ? "seq_lens" : "query", " has ",
              d.num_seqs, " sequences");
  d.max_blocks_per_seq = block_tables.size(1);
  check_dtype(op, seq_lens, "seq_lens", at::kInt);
  check_contiguous(op, seq_lens, "seq_lens");
  TORCH_CHECK(seq_lens.size(0) == d.num_seqs, op, ": seq_lens has ", seq_lens.size(0),
              " entries but query has ", d.num_seqs, " sequences");

  TORCH_CHECK(max_seq_len >= 0, op, ": max_seq_len must be non-negative, got ", max_seq_len);
  TORCH_CHECK((max_seq_len + block_size - 1) / block_size <= d.max_blocks_per_seq || d.num_seqs == 0,
              op, ": block_tables has ", d.max_blocks_per_seq,
              " columns, fewer than the ", (max_seq_len + block_size - 1) / block_size,
              " blocks that max_seq_len=", max_seq_len, " needs at block_size=", block_size);

  if (alibi_slopes.has_value()) {
    const auto& a = *alibi_slopes;
    check_same_device(op, a, "alibi_slopes", query, "query");
    check_dtype(op, a, "alibi_slopes", at::kFloat);
    TORCH_CHECK(a.dim() == 1 && a.size(0) == d.num_heads && a.is_contiguous(), op,
                ": alibi_slopes must be a contiguous [num_heads=", d.num_heads,
                "] tensor, got shape ", a.sizes());
  }
  return d;
}

}  // namespace

PagedAttentionDims check_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
    const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
    double k_scale, double v_scale) {
  return check_attention_common("paged_attention", out, query, key_cache, value_cache,
                                num_kv_heads, block_tables, seq_lens, block_size, max_seq_len,
                                alibi_slopes, kv_cache_dtype, k_scale, v_scale, false);
}

PagedAttentionDims check_varlen_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t block_size,
    int64_t max_query_len, int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
    const std::string& kv_cache_dtype, double k_scale, double v_scale) {
  constexpr const char* op = "varlen_paged_attention";
  const auto d = check_attention_common(op, out, query, key_cache, value_cache, num_kv_heads,
                                        block_tables, seq_lens, block_size, max_seq_len,
                                        alibi_slopes, kv_cache_dtype, k_scale, v_scale, true);
  check_same_device(op, query_start_loc, "query_start_loc", query, "query");
  check_dim(op, query_start_loc, "query_start_loc", 1, "[num_seqs + 1]");
  check_dtype(op, query_start_loc, "query_start_loc", at::kInt);
  check_contiguous(op, query_start_loc, "query_start_loc");
  TORCH_CHECK(query_start_loc.size(0) == d.num_seqs + 1, op, ": query_start_loc must have ",
              "num_seqs + 1 = ", d.num_seqs + 1, " entries, got ", query_start_loc.size(0));
  TORCH_CHECK(max_query_len >= 0, op, ": max_query_len must be non-negative, got ",
              max_query_len);
  TORCH_CHECK(max_query_len <= max_seq_len || d.num_tokens == 0, op, ": max_query_len (",
              max_query_len, ") exceeds max_seq_len (", max_seq_len,
              "): a sequence's new tokens are part of its context");
  return d;
}

void check_varlen_paged_attention_values(const PagedAttentionDims& d,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc,
                                         int64_t max_query_len, int64_t max_seq_len) {
  constexpr const char* op = "varlen_paged_attention";
  check_attention_values(op, d, block_tables, seq_lens, max_seq_len);
  if (on_cpu(query_start_loc)) {
    const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      const int64_t n = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
      TORCH_CHECK(n >= 0 && n <= max_query_len, op, ": sequence ", s, " has ", n,
                  " query tokens (query_start_loc[", s + 1, "] - query_start_loc[", s,
                  "]), outside [0, max_query_len=", max_query_len, "]");
      TORCH_CHECK(n <= lens[s], op, ": sequence ", s, " has ", n, " query tokens but seq_lens[",
                  s, "] = ", lens[s], " (seq_lens counts the cached context plus the new tokens)");
    }
    TORCH_CHECK(qsl[d.num_seqs] == d.num_tokens, op, ": query_start_loc[", d.num_seqs, "] = ",
                qsl[d.num_seqs], " must equal query's ", d.num_tokens, " tokens");
    return;
  }
  // One round trip for all checks.
  const auto q = query_start_loc.to(at::kLong);
  const auto n = q.slice(0, 1) - q.slice(0, 0, d.num_seqs);
  const auto bad = (n < 0) | (n > max_query_len) | (n > seq_lens.to(at::kLong));
  const auto stats =
      at::stack({q[0], q[d.num_seqs], bad.any().to(at::kLong)}).cpu();
  const int64_t* v = stats.data_ptr<int64_t>();
  TORCH_CHECK(v[0] == 0 && v[1] == d.num_tokens, op, ": query_start_loc must start at 0 and ",
              "end at query's ", d.num_tokens, " tokens, got ", v[0], " and ", v[1]);
  TORCH_CHECK(v[2] == 0, op, ": some sequence's query token count (query_start_loc[i + 1] - ",
              "query_start_loc[i]) is negative, exceeds max_query_len=", max_query_len,
              " or exceeds its seq_lens entry");
}

int64_t check_paged_attention_v2_scratch(
    const PagedAttentionDims& d, const at::Tensor& out, const at::Tensor& exp_sums,
    const at::Tensor& max_logits, const at::Tensor& tmp_out, int64_t max_seq_len) {
  constexpr const char* op = "paged_attention_v2";
  const int64_t need = (max_seq_len + kPartitionSize - 1) / kPartitionSize;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{exp_sums, "exp_sums"},
                                {max_logits, "max_logits"}}) {
    check_same_device(op, t, name, out, "out");
    check_dtype(op, t, name, at::kFloat);
    check_contiguous(op, t, name);
    check_dim(op, t, name, 3, "[num_seqs, num_heads, max_num_partitions]");
    TORCH_CHECK(t.size(0) == d.num_seqs && t.size(1) == d.num_heads && t.size(2) >= need, op,
                ": ", name, " must be [", d.num_seqs, ", ", d.num_heads, ", >= ", need,
                "] for max_seq_len=", max_seq_len, ", got ", t.sizes());
  }
  TORCH_CHECK(max_logits.sizes() == exp_sums.sizes(), op, ": max_logits ", max_logits.sizes(),
              " and exp_sums ", exp_sums.sizes(), " must have one shape");
  const int64_t p = exp_sums.size(2);
  check_same_device(op, tmp_out, "tmp_out", out, "out");
  check_dtype(op, tmp_out, "tmp_out", out.scalar_type());
  check_contiguous(op, tmp_out, "tmp_out");
  const std::vector<int64_t> want{d.num_seqs, d.num_heads, p, d.head_size};
  TORCH_CHECK(tmp_out.sizes() == at::IntArrayRef(want), op, ": tmp_out must have shape ",
              at::IntArrayRef(want), ", got ", tmp_out.sizes());
  return p;
}

void check_paged_attention_values(
    const PagedAttentionDims& d, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    int64_t max_seq_len) {
  check_attention_values("paged_attention", d, block_tables, seq_lens, max_seq_len);
}

void check_attention_values(const char* op, const PagedAttentionDims& d,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            int64_t max_seq_len) {
  if (d.num_seqs == 0) return;
  if (on_cpu(seq_lens)) {
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      const int64_t len = lens[s];
      TORCH_CHECK(len >= 0 && len <= max_seq_len, op, ": seq_lens[", s, "] = ", len,
                  " is outside [0, max_seq_len=", max_seq_len, "]");
      const int64_t nblocks = (len + d.block_size - 1) / d.block_size;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t id = tables[s * d.max_blocks_per_seq + b];
        TORCH_CHECK(id >= 0 && id < d.num_blocks, op, ": block_tables[", s, ", ", b, "] = ", id,
                    " is outside the cache's ", d.num_blocks, " blocks");
      }
    }
    return;
  }
  // One round trip for all checks: gather the used table entries with tensor ops.
  const auto lens = seq_lens.to(at::kLong);
  const auto nblocks = (lens + (d.block_size - 1)).div(d.block_size, "floor");
  const auto cols = at::arange(d.max_blocks_per_seq, lens.options()).unsqueeze(0);
  const auto used = cols < nblocks.unsqueeze(1);
  const auto ids = block_tables.to(at::kLong);
  const auto bad_id = (used & ((ids < 0) | (ids >= d.num_blocks))).any();
  const auto stats = at::stack({lens.min(), lens.max(), bad_id.to(at::kLong)}).cpu();
  const int64_t* v = stats.data_ptr<int64_t>();
  TORCH_CHECK(v[0] >= 0 && v[1] <= max_seq_len, op, ": seq_lens must lie in [0, max_seq_len=",
              max_seq_len, "], got values in [", v[0], ", ", v[1], "]");
  TORCH_CHECK(v[2] == 0, op, ": block_tables names a block outside the cache's ", d.num_blocks,
              " blocks within some sequence's length");
}

CacheWriteDims check_reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::string& kv_cache_dtype, double k_scale, double v_scale, bool flash_layout) {
  const char* op = flash_layout ? "reshape_and_cache_flash" : "reshape_and_cache";
  const KvCacheDType kind = check_kv_cache_dtype(op, kv_cache_dtype, k_scale, v_scale);
  check_dim(op, key, "key", 3, "[num_tokens, num_kv_heads, head_size]");
  check_float_dtype(op, key, "key");
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value must have key's shape ", key.sizes(),
              ", got ", value.sizes());
  check_dtype(op, value, "value", key.scalar_type());
  check_cache_dtype(op, key_cache, "key_cache", key.scalar_type(), kind);
  check_cache_dtype(op, value_cache, "value_cache", key.scalar_type(), kind);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{value, "value"},
                                {key_cache, "key_cache"},
                                {value_cache, "value_cache"},
                                {slot_mapping, "slot_mapping"}}) {
    check_same_device(op, t, name, key, "key");
  }
  CacheWriteDims d{};
  d.op = op;
  d.num_tokens = key.size(0);
  d.num_kv_heads = key.size(1);
  d.head_size = key.size(2);
  check_head_size(op, d.head_size);
  // A token's heads must be packed; tokens may be strided (slices of a fused QKV output).
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{key, "key"},
                                {value, "value"}}) {
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == d.head_size, op, ": ", name,
                " must have packed heads (strides [*, ", d.head_size, ", 1]), got strides ",
                t.strides());
  }
  d.key_stride = key.stride(0);
  d.value_stride = value.stride(0);
  check_contiguous(op, key_cache, "key_cache");
  check_contiguous(op, value_cache, "value_cache");
  d.cache_dtype = kind;
  d.x = key_chunk_elems(key.scalar_type(), kind);
  if (!flash_layout) check_head_size_fits_x(op, d.head_size, d.x, kv_cache_dtype);
  if (flash_layout) {
    check_dim(op, key_cache, "key_cache", 4, "[num_blocks, block_size, num_kv_heads, head_size]");
    d.num_blocks = key_cache.size(0);
    d.block_size = key_cache.size(1);
    const std::vector<int64_t> want{d.num_blocks, d.block_size, d.num_kv_heads, d.head_size};
    TORCH_CHECK(key_cache.sizes() == at::IntArrayRef(want), op, ": key_cache must have shape ",
                at::IntArrayRef(want), " to hold key ", key.sizes(), ", got ", key_cache.sizes());
    TORCH_CHECK(value_cache.sizes() == at::IntArrayRef(want), op,
                ": value_cache must have shape ", at::IntArrayRef(want), ", got ",
                value_cache.sizes());
  } else {
    check_dim(op, key_cache, "key_cache", 5,
              "[num_blocks, num_kv_heads, head_size / x, block_size, x]");
    check_dim(op, value_cache, "value_cache", 4,
              "[num_blocks, num_kv_heads, head_size, block_size]");
    d.num_blocks = key_cache.size(0);
    d.block_size = key_cache.size(3);
    const std::vector<int64_t> want_k{d.num_blocks, d.num_kv_heads, d.head_size / d.x,
                                      d.block_size, d.x};
    TORCH_CHECK(key_cache.sizes() == at::IntArrayRef(want_k), op,
                ": key_cache must have shape ", at::IntArrayRef(want_k), " to hold key ",
                key.sizes(), " (x=", d.x, "), got ", key_cache.sizes());
    const std::vector<int64_t> want_v{d.num_blocks, d.num_kv_heads, d.head_size, d.block_size};
    TORCH_CHECK(value_cache.sizes() == at::IntArrayRef(want_v), op,
                ": value_cache must have shape ", at::IntArrayRef(want_v), ", got ",
                value_cache.sizes());
  }
  TORCH_CHECK(d.block_size > 0, op, ": the caches' block_size must be positive");
  check_dim(op, slot_mapping, "slot_mapping", 1, "[num_tokens]");
  check_dtype(op, slot_mapping, "slot_mapping", at::kLong);
  check_contiguous(op, slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.size(0) == d.num_tokens, op, ": slot_mapping has ",
              slot_mapping.size(0), " entries but key has ", d.num_tokens, " tokens");
  return d;
}

void check_slot_mapping_values(const CacheWriteDims& d, const at::Tensor& slot_mapping) {
  if (d.num_tokens == 0) return;
  const int64_t num_slots = d.num_blocks * d.block_size;
  int64_t max_slot;
  if (on_cpu(slot_mapping)) {
    const int64_t* s = slot_mapping.data_ptr<int64_t>();
    max_slot = *std::max_element(s, s + d.num_tokens);
  } else {
    max_slot = slot_mapping.max().item<int64_t>();
  }
  TORCH_CHECK(max_slot < num_slots, d.op, ": slot_mapping holds slot ", max_slot,
              " but the cache has only ", num_slots, " slots (", d.num_blocks, " blocks of ",
              d.block_size, ")");
}

int64_t check_copy_blocks(
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& block_mapping, bool check_values) {
  constexpr const char* op = "copy_blocks";
  TORCH_CHECK(key_caches.size() == value_caches.size(), op, ": got ", key_caches.size(),
              " key caches but ", value_caches.size(), " value caches");
  check_dim(op, block_mapping, "block_mapping", 2, "[num_pairs, 2]");
  TORCH_CHECK(block_mapping.size(1) == 2, op, ": block_mapping must be [num_pairs, 2], got ",
              block_mapping.sizes());
  check_dtype(op, block_mapping, "block_mapping", at::kLong);
  check_contiguous(op, block_mapping, "block_mapping");
  if (key_caches.empty()) return 0;
  const auto& ref = key_caches[0];
  const int64_t num_blocks = ref.size(0);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    for (const auto* t : {&key_caches[i], &value_caches[i]}) {
      const char* name = t == &key_caches[i] ? "key_caches" : "value_caches";
      TORCH_CHECK(t->device() == ref.device(), op, ": ", name, "[", i, "] is on ", t->device(),
                  " but key_caches[0] is on ", ref.device());
      TORCH_CHECK(t->scalar_type() == ref.scalar_type(), op, ": ", name, "[", i, "] is ",
                  t->scalar_type(), " but key_caches[0] is ", ref.scalar_type());
      TORCH_CHECK(t->is_contiguous(), op, ": ", name, "[", i, "] must be contiguous");
      TORCH_CHECK(t->dim() >= 2 && t->size(0) == num_blocks, op, ": ", name, "[", i,
                  "] has shape ", t->sizes(), " but key_caches[0] has ", num_blocks, " blocks");
    }
    TORCH_CHECK(value_caches[i].numel() == key_caches[i].numel(), op, ": value_caches[", i,
                "] ", value_caches[i].sizes(), " must hold as many elements as key_caches[", i,
                "] ", key_caches[i].sizes());
  }
  TORCH_CHECK(block_mapping.device() == ref.device(), op, ": block_mapping is on ",
              block_mapping.device(), " but the caches are on ", ref.device());
  if (check_values && block_mapping.numel() > 0) {
    const auto mm = at::stack({block_mapping.min(), block_mapping.max()}).cpu();
    const int64_t lo = mm.data_ptr<int64_t>()[0], hi = mm.data_ptr<int64_t>()[1];
    TORCH_CHECK(lo >= 0 && hi < num_blocks, op, ": block_mapping holds block ids in [", lo, ", ",
                hi, "] but the caches have ", num_blocks, " blocks");
  }
  return num_blocks;
}

int64_t check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                          const at::Tensor& block_mapping) {
  constexpr const char* op = "swap_blocks";
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src is ", src.scalar_type(),
              " but dst is ", dst.scalar_type());
  TORCH_CHECK(src.dim() >= 1 && dst.dim() == src.dim() &&
                  src.sizes().slice(1) == dst.sizes().slice(1),
              op, ": src ", src.sizes(), " and dst ", dst.sizes(),
              " must differ only in the number of blocks");
  check_contiguous(op, src, "src");
  check_contiguous(op, dst, "dst");
  TORCH_CHECK(block_mapping.device().is_cpu(), op, ": block_mapping must be on the CPU, got ",
              block_mapping.device());
  check_dim(op, block_mapping, "block_mapping", 2, "[num_pairs, 2]");
  TORCH_CHECK(block_mapping.size(1) == 2, op, ": block_mapping must be [num_pairs, 2], got ",
              block_mapping.sizes());
  check_dtype(op, block_mapping, "block_mapping", at::kLong);
  check_contiguous(op, block_mapping, "block_mapping");
  const int64_t* m = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    TORCH_CHECK(m[2 * i] >= 0 && m[2 * i] < src.size(0), op, ": block_mapping[", i,
                ", 0] = ", m[2 * i], " is outside src's ", src.size(0), " blocks");
    TORCH_CHECK(m[2 * i + 1] >= 0 && m[2 * i + 1] < dst.size(0), op, ": block_mapping[", i,
                ", 1] = ", m[2 * i + 1], " is outside dst's ", dst.size(0), " blocks");
  }
  return src.size(0) == 0 ? 0 : src.numel() / src.size(0) * src.element_size();
}

namespace {

// qweight [N, row] or packed in panels [ceil(N / panel_cols), row, panel_cols]
// (pack_linear_weight's layout); the rows N come from `scales` when packed. Returns N.
int64_t check_quant_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                           const char* row, int64_t panel_cols) {
  check_contiguous(op, qweight, "qweight");
  if (qweight.dim() != 3) {
    TORCH_CHECK(qweight.dim() == 2, op, ": qweight must be [N, ", row, "] or packed [panels, ",
                row, ", ", panel_cols, "], got shape ", qweight.sizes());
    return qweight.size(0);
  }
  TORCH_CHECK(scales.dim() >= 1, op, ": scales must be [N, ...], got a scalar");
  const int64_t n = scales.size(0);
  TORCH_CHECK(qweight.size(2) == panel_cols && qweight.size(0) == (n + panel_cols - 1) / panel_cols,
              op, ": a packed qweight must be pack_linear_weight's [ceil(N / ", panel_cols,
              "), ", row, ", ", panel_cols, "] for scales' N = ", n, ", got shape ",
              qweight.sizes());
  return n;
}

}  // namespace

int64_t check_int8_linear(const at::Tensor& x, const at::Tensor& qweight,
                          const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                          int64_t panel_cols) {
  const char* op = "int8_linear";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be Float or BFloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K], got a scalar");
  check_dtype(op, qweight, "qweight", at::kChar);
  check_same_device(op, qweight, "qweight", x, "x");
  const int64_t n = check_quant_weight(op, qweight, scales, "K", panel_cols);
  TORCH_CHECK(x.size(-1) == qweight.size(1), op, ": x's last dimension (", x.size(-1),
              ") must equal qweight's K (", qweight.size(1), ")");
  check_dtype(op, scales, "scales", at::kFloat);
  const int64_t k = qweight.size(1);
  if (scales.dim() == 2) {  // groups of G consecutive weights of a row share a scale
    const int64_t groups = scales.size(1);
    TORCH_CHECK(scales.size(0) == n && groups > 0 && k % groups == 0 &&
                    (k / groups == 32 || k / groups == 64 || k / groups == 128),
                op, ": scales must be [N] or [N, K / G] with G 32, 64 or 128 (N = ", n,
                ", K = ", k, "), got shape ", scales.sizes());
  } else {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, op,
                ": scales must be [N] or [N, K / G] with G 32, 64 or 128 (N = ", n, ", K = ",
                k, "), got shape ", scales.sizes());
  }
  check_contiguous(op, scales, "scales");
  check_same_device(op, scales, "scales", x, "x");
  if (bias.has_value()) {
    check_dtype(op, *bias, "bias", at::kFloat);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [N] = [", n,
                "], got shape ", bias->sizes());
    check_contiguous(op, *bias, "bias");
    check_same_device(op, *bias, "bias", x, "x");
  }
  return n;
}

void check_pack_linear_weight(const at::Tensor& weight) {
  const char* op = "pack_linear_weight";
  const at::ScalarType t = weight.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar || t == at::kByte, op,
              ": weight must be Float or BFloat16 (packed_linear), Char (int8_linear's qweight) "
              "or Byte (int4_linear's), got ", t);
  check_dim(op, weight, "weight", 2, "[N, K]");
  TORCH_CHECK(weight.device().is_cpu(), op, ": weight must be on the CPU, got ", weight.device());
  const bool pairs = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.size(0) >= 1 && weight.size(1) >= 1 && (!pairs || weight.size(1) % 2 == 0),
              op, ": weight [N, K] needs N >= 1 and K >= 1", pairs ? ", K even for BFloat16 "
              "(the kernel multiplies pairs of k)" : "", ", got shape ", weight.sizes());
}

void check_packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features,
                         int64_t panel_cols, bool gated) {
  const char* op = gated ? "packed_gated_linear" : "packed_linear";
  const char* out_name = gated ? "intermediate_size" : "out_features";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be Float or BFloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K], got a scalar");
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  check_dtype(op, packed_weight, "packed_weight", x.scalar_type());
  const bool pairs = x.scalar_type() == at::kBFloat16;
  if (pairs) {
    check_dim(op, packed_weight, "packed_weight", 4, "[panels, K / 2, panel columns, 2]");
  } else {
    check_dim(op, packed_weight, "packed_weight", 3, "[panels, K, panel columns]");
  }
  check_contiguous(op, packed_weight, "packed_weight");
  check_same_device(op, packed_weight, "packed_weight", x, "x");
  const int64_t panels = packed_weight.size(0);
  const int64_t k = pairs ? 2 * packed_weight.size(1) : packed_weight.size(1);
  TORCH_CHECK(packed_weight.size(2) == panel_cols && (!pairs || packed_weight.size(3) == 2), op,
              ": packed_weight must be pack_linear_weight's ",
              pairs ? "[panels, K / 2, " : "[panels, K, ", panel_cols, pairs ? ", 2]" : "]",
              ", got shape ", packed_weight.sizes());
  TORCH_CHECK(x.size(-1) == k, op, ": x's last dimension (", x.size(-1),
              ") must equal packed_weight's K (", k, ")");
  // A gated panel holds half its columns' worth of outputs (gate and up features).
  const int64_t outputs_per_panel = gated ? panel_cols / 2 : panel_cols;
  const int64_t needed = (out_features + outputs_per_panel - 1) / outputs_per_panel;
  TORCH_CHECK(out_features >= 1 && needed == panels, op, ": ", out_name, " ", out_features,
              " does not match packed_weight's ", panels, " panels of ", outputs_per_panel,
              gated ? " outputs" : " columns");
  if (bias.has_value()) {
    // A gated weight's bias is in its column order (ops.gated_panel_rows), every panel full.
    const int64_t bias_len = gated ? panels * panel_cols : out_features;
    check_dtype(op, *bias, "bias", at::kFloat);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == bias_len, op, ": bias must be [",
                gated ? "panels * panel columns" : "out_features", "] = [", bias_len,
                "], got shape ", bias->sizes());
    check_contiguous(op, *bias, "bias");
    check_same_device(op, *bias, "bias", x, "x");
  }
}

int64_t check_int4_linear(const at::Tensor& x, const at::Tensor& qweight,
                          const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                          const std::optional<at::Tensor>& bias, int64_t panel_cols) {
  const char* op = "int4_linear";
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be Float or BFloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K], got a scalar");
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, op,
              ": group_size must be 32, 64 or 128, got ", group_size);
  check_dtype(op, qweight, "qweight", at::kByte);
  check_same_device(op, qweight, "qweight", x, "x");
  const int64_t n = check_quant_weight(op, qweight, scales, "K / 2", panel_cols);
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % group_size == 0, op, ": x's last dimension K (", k,
              ") must be a multiple of group_size (", group_size, ")");
  TORCH_CHECK(qweight.size(1) * 2 == k, op, ": qweight must be [N, K / 2] (packed: [panels, K / 2, ",
              panel_cols, "]) with K / 2 = ", k / 2, " for x's K = ", k, ", got shape ",
              qweight.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{scales, "scales"},
                                {zeros, "zeros"}}) {
    check_dtype(op, t, name, at::kFloat);
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == k / group_size, op, ": ", name,
                " must be [N, K / group_size] = [", n, ", ", k / group_size, "], got shape ",
                t.sizes());
    check_contiguous(op, t, name);
    check_same_device(op, t, name, x, "x");
  }
  if (bias.has_value()) {
    check_dtype(op, *bias, "bias", at::kFloat);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [N] = [", n,
                "], got shape ", bias->sizes());
    check_contiguous(op, *bias, "bias");
    check_same_device(op, *bias, "bias", x, "x");
  }
  return n;
}

MoeDims check_fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,
                        const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,
                        int64_t packed_panel_cols) {
  const char* op = "fused_moe";
  check_float_dtype(op, hidden, "hidden");
  check_dim(op, hidden, "hidden", 2, "[T, H]");
  check_contiguous(op, hidden, "hidden");
  check_float_dtype(op, router_logits, "router_logits");
  check_dim(op, router_logits, "router_logits", 2, "[T, E]");
  check_contiguous(op, router_logits, "router_logits");
  check_same_device(op, router_logits, "router_logits", hidden, "hidden");
  const int64_t tokens = hidden.size(0), h = hidden.size(1), e = router_logits.size(1);
  TORCH_CHECK(h >= 1, op, ": hidden [T, H] needs H >= 1, got shape ", hidden.sizes());
  TORCH_CHECK(router_logits.size(0) == tokens, op, ": router_logits has ", router_logits.size(0),
              " rows but hidden has ", tokens, " tokens");
  TORCH_CHECK(e >= 1 && e <= kMoeMaxNumExperts, op, ": the expert count E (router_logits' ",
              "last dimension) must be in [1, ", kMoeMaxNumExperts, "], got ", e);
  TORCH_CHECK(top_k >= 1 && top_k <= kMoeMaxTopK, op, ": top_k must be in [1, ", kMoeMaxTopK,
              "], got ", top_k);
  TORCH_CHECK(top_k <= e, op, ": top_k (", top_k, ") exceeds the expert count E (", e,
              "): a token cannot be routed to more experts than there are");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{w13, "w13"},
                                std::pair<const at::Tensor&, const char*>{w2, "w2"}}) {
    check_same_device(op, t, name, hidden, "hidden");
    TORCH_CHECK(t.scalar_type() == hidden.scalar_type(), op, ": ", name, " is ",
                t.scalar_type(), " but hidden is ", hidden.scalar_type(),
                "; the weights must have hidden's dtype");
    check_contiguous(op, t, name);
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == e, op, ": ", name, " must hold E = ", e,
                " experts (router_logits' last dimension) in its first dimension, got shape ",
                t.sizes());
  }
  if (w13.dim() == 3 || w2.dim() == 3 || packed_panel_cols <= 0) {
    check_dim(op, w13, "w13", 3, "[E, 2I, H]");
    check_dim(op, w2, "w2", 3, "[E, H, I]");
    const int64_t inter = w2.size(2);
    TORCH_CHECK(inter >= 1 && w2.size(1) == h, op, ": w2 must be [E, H, I] = [", e, ", ", h,
                ", I] with I >= 1, got shape ", w2.sizes());
    TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == h, op, ": w13 must be [E, 2I, H] = [",
                e, ", ", 2 * inter, ", ", h, "] (I from w2), got shape ", w13.sizes());
    return {tokens, h, e, inter, top_k, false};
  }
  // Packed per expert (pack_moe_weights): pack_linear_weight's layout with an expert
  // dimension in front.
  const bool pairs = hidden.scalar_type() == at::kBFloat16;
  TORCH_CHECK(hidden.scalar_type() != at::kHalf, op,
              ": packed weights are float32 or bfloat16; float16 takes w13 [E, 2I, H] and "
              "w2 [E, H, I]");
  const int64_t rank = pairs ? 5 : 4;
  const char* w13_layout = pairs ? "[E, panels, H / 2, panel columns, 2] (pack_moe_weights)"
                                 : "[E, panels, H, panel columns] (pack_moe_weights)";
  const char* w2_layout = pairs ? "[E, panels, I / 2, panel columns, 2] (pack_moe_weights)"
                                : "[E, panels, I, panel columns] (pack_moe_weights)";
  check_dim(op, w13, "w13", rank, w13_layout);
  check_dim(op, w2, "w2", rank, w2_layout);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{w13, "w13"},
                                std::pair<const at::Tensor&, const char*>{w2, "w2"}}) {
    TORCH_CHECK(t.size(3) == packed_panel_cols && (!pairs || t.size(4) == 2), op, ": ", name,
                " must be packed with ", packed_panel_cols, " panel columns", pairs ? " and "
                "pairs of k" : "", ", got shape ", t.sizes());
  }
  const int64_t k_mult = pairs ? 2 : 1;
  const int64_t inter = w2.size(2) * k_mult;
  const int64_t gated_cols = packed_panel_cols / 2;
  TORCH_CHECK(inter >= 1 && w2.size(1) == (h + packed_panel_cols - 1) / packed_panel_cols, op,
              ": w2 must be the packed [E, H, I] with H = ", h, ", got shape ", w2.sizes());
  TORCH_CHECK(w13.size(2) * k_mult == h && w13.size(1) == (inter + gated_cols - 1) / gated_cols,
              op, ": w13 must be the packed [E, 2I, H] with H = ", h, " and I = ", inter,
              " (from w2), got shape ", w13.sizes());
  TORCH_CHECK(!pairs || h % 2 == 0, op, ": packed bfloat16 weights need an even H, got ", h);
  return {tokens, h, e, inter, top_k, true};
}

namespace {

void check_same_dtype(const char* op, const at::Tensor& t, const char* name,
                      const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              " but ", ref_name, " is ", ref.scalar_type(), "; they must have one dtype");
}

// t viewed as [rows, t.size(-1)]: the last dim contiguous and the leading dims one stride.
RowsDims rows_of(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, " must have at least 1 dimension, got a scalar");
  const int64_t n = t.dim();
  const int64_t hidden = t.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < n; ++i) rows *= t.size(i);
  TORCH_CHECK(t.stride(-1) == 1 || hidden <= 1, op, ": ", name,
              "'s last dimension must be contiguous, got strides ", t.strides());
  int64_t row_stride = hidden;  // a single row
  // Leading dims collapse into one row index when each stride is the next one's span
  // (size-1 dims have any stride).
  int64_t expect = -1;
  for (int64_t i = n - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (expect >= 0) {
      TORCH_CHECK(t.stride(i) == expect, op, ": ", name, "'s leading dimensions must collapse "
                  "into rows of one stride (shape ", t.sizes(), ", strides ", t.strides(), ")");
    } else {
      row_stride = t.stride(i);
    }
    expect = t.stride(i) * t.size(i);
  }
  TORCH_CHECK(rows <= 1 || row_stride >= hidden, op, ": ", name, "'s rows overlap (row stride ",
              row_stride, " < ", hidden, ")");
  return {rows, hidden, row_stride};
}

void check_norm_weight(const char* op, const at::Tensor& weight, const at::Tensor& input,
                       const char* input_name, int64_t hidden, double epsilon) {
  check_same_device(op, weight, "weight", input, input_name);
  check_same_dtype(op, weight, "weight", input, input_name);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op, ": weight must be [hidden] = [",
              hidden, "], got shape ", weight.sizes());
  check_contiguous(op, weight, "weight");
  TORCH_CHECK(std::isfinite(epsilon) && epsilon >= 0, op,
              ": epsilon must be finite and >= 0, got ", epsilon);
}

}  // namespace

RowsDims check_rms_norm(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                        double epsilon) {
  const char* op = "rms_norm";
  check_float_dtype(op, input, "input");
  const RowsDims d = rows_of(op, input, "input");
  check_same_device(op, out, "out", input, "input");
  check_same_dtype(op, out, "out", input, "input");
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out must have input's shape ", input.sizes(),
              ", got ", out.sizes());
  check_contiguous(op, out, "out");
  check_norm_weight(op, weight, input, "input", d.hidden, epsilon);
  return d;
}

RowsDims check_fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                  const at::Tensor& weight, double epsilon) {
  const char* op = "fused_add_rms_norm";
  check_float_dtype(op, input, "input");
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least 1 dimension, got a scalar");
  check_contiguous(op, input, "input");
  check_same_device(op, residual, "residual", input, "input");
  check_same_dtype(op, residual, "residual", input, "input");
  TORCH_CHECK(residual.sizes() == input.sizes(), op, ": residual must have input's shape ",
              input.sizes(), ", got ", residual.sizes());
  check_contiguous(op, residual, "residual");
  const RowsDims d = rows_of(op, input, "input");
  check_norm_weight(op, weight, input, "input", d.hidden, epsilon);
  return d;
}

RowsDims check_silu_and_mul(const at::Tensor& out, const at::Tensor& input) {
  const char* op = "silu_and_mul";
  check_float_dtype(op, input, "input");
  RowsDims d = rows_of(op, input, "input");
  TORCH_CHECK(d.hidden % 2 == 0, op, ": input's last dimension must be even ([..., 2 * d]), got ",
              d.hidden);
  d.hidden /= 2;
  check_same_device(op, out, "out", input, "input");
  check_same_dtype(op, out, "out", input, "input");
  std::vector<int64_t> want(input.sizes().begin(), input.sizes().end());
  want.back() = d.hidden;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(want), op, ": out must be ", at::IntArrayRef(want),
              " for input ", input.sizes(), ", got ", out.sizes());
  check_contiguous(op, out, "out");
  return d;
}

RowsDims check_greedy_sample(const at::Tensor& logits, const at::Tensor& token_ids,
                             const at::Tensor& logprobs) {
  const char* op = "greedy_sample";
  check_float_dtype(op, logits, "logits");
  check_dim(op, logits, "logits", 2, "[num_rows, vocab]");
  const RowsDims d = rows_of(op, logits, "logits");
  TORCH_CHECK(d.hidden >= 1 && d.hidden < (int64_t{1} << 31), op,
              ": logits' vocab must be in [1, 2^31), got ", d.hidden);
  const auto check_per_row = [&](const at::Tensor& t, const char* name, at::ScalarType dtype) {
    check_dtype(op, t, name, dtype);
    check_same_device(op, t, name, logits, "logits");
    TORCH_CHECK(t.dim() == 1 && t.size(0) == d.rows, op, ": ", name, " must be [", d.rows,
                "] (one per row of logits), got shape ", t.sizes());
    check_contiguous(op, t, name);
  };
  check_per_row(token_ids, "token_ids", at::kLong);
  check_per_row(logprobs, "logprobs", at::kFloat);
  return d;
}

namespace {

// query / key: [num_tokens, heads * head_size] or [num_tokens, heads, head_size], heads
// contiguous within a token. Returns (heads, token stride).
std::pair<int64_t, int64_t> rotary_heads(const char* op, const at::Tensor& t, const char* name,
                                         int64_t num_tokens, int64_t head_size) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, op, ": ", name, " must be [num_tokens, heads * "
              "head_size] or [num_tokens, heads, head_size], got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == num_tokens, op, ": ", name, " has ", t.size(0),
              " tokens but positions has ", num_tokens);
  int64_t heads;
  if (t.dim() == 3) {
    TORCH_CHECK(t.size(2) == head_size, op, ": ", name, "'s last dimension (", t.size(2),
                ") must be head_size (", head_size, ")");
    heads = t.size(1);
    TORCH_CHECK(t.stride(2) == 1 && (heads <= 1 || t.stride(1) == head_size), op, ": ", name,
                "'s heads must be contiguous within a token, got strides ", t.strides());
  } else {
    TORCH_CHECK(t.size(1) % head_size == 0, op, ": ", name, "'s width (", t.size(1),
                ") must be a multiple of head_size (", head_size, ")");
    heads = t.size(1) / head_size;
    TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
                "'s last dimension must be contiguous, got strides ", t.strides());
  }
  const int64_t stride = t.stride(0);
  TORCH_CHECK(num_tokens <= 1 || stride >= heads * head_size, op, ": ", name,
              "'s tokens overlap (token stride ", stride, " < ", heads * head_size, ")");
  return {heads, stride};
}

}  // namespace

RotaryDims check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                  const at::Tensor& key, int64_t head_size,
                                  const at::Tensor& cos_sin_cache, bool /*is_neox*/) {
  const char* op = "rotary_embedding";
  check_dtype(op, positions, "positions", at::kLong);
  check_dim(op, positions, "positions", 1, "[num_tokens]");
  check_contiguous(op, positions, "positions");
  TORCH_CHECK(head_size > 0, op, ": head_size must be positive, got ", head_size);
  check_float_dtype(op, query, "query");
  check_same_device(op, query, "query", positions, "positions");
  check_same_device(op, key, "key", positions, "positions");
  check_same_dtype(op, key, "key", query, "query");
  check_same_device(op, cos_sin_cache, "cos_sin_cache", positions, "positions");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat ||
                  cos_sin_cache.scalar_type() == query.scalar_type(),
              op, ": cos_sin_cache must be float32 or the query dtype (", query.scalar_type(),
              "), got ", cos_sin_cache.scalar_type());
  check_dim(op, cos_sin_cache, "cos_sin_cache", 2, "[max_position, rot_dim]");
  check_contiguous(op, cos_sin_cache, "cos_sin_cache");
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_size, op,
              ": cos_sin_cache's width (rot_dim ", rot_dim, ") must be even, positive and <= "
              "head_size (", head_size, ")");
  const int64_t n = positions.size(0);
  const auto [heads, q_stride] = rotary_heads(op, query, "query", n, head_size);
  const auto [kv_heads, k_stride] = rotary_heads(op, key, "key", n, head_size);
  TORCH_CHECK(query.data_ptr() != key.data_ptr() || n * heads * kv_heads == 0, op,
              ": query and key must not be the same memory");
  return {n, heads, kv_heads, head_size, rot_dim, cos_sin_cache.size(0), q_stride, k_stride};
}

void check_rotary_positions(const RotaryDims& d, const at::Tensor& positions) {
  if (d.num_tokens == 0) return;
  const at::Tensor p = positions.device().is_cpu() ? positions : positions.cpu();
  const int64_t* v = p.data_ptr<int64_t>();
  for (int64_t i = 0; i < d.num_tokens; ++i) {
    TORCH_CHECK(v[i] >= 0 && v[i] < d.max_position, "rotary_embedding: positions[", i, "] = ",
                v[i], " is outside the table's ", d.max_position, " positions");
  }
}

}  // namespace vllm_lite
