// Argument validation shared by the CPU and CUDA implementations, so every device
// rejects the same bad input with the same message. Shape, dtype and device checks
// read only metadata; the *_values checks read tensor contents (a device sync on
// CUDA, so the CUDA launchers run them only with VLLM_LITE_CHECK_VALUES=1 and never
// while a CUDA graph is being captured; the CPU kernels always run them).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "kv_cache_dtype.h"

namespace vllm_lite {

struct PagedAttentionDims {
  int64_t num_seqs;
  int64_t num_tokens;  // query rows: num_seqs for paged_attention, flat for varlen
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
  int64_t x;  // elements per 16-byte chunk of the key cache (split layout)
  // The caches' layout, told apart by the key cache's rank: false = the split layout
  // (key [num_blocks, num_kv_heads, head_size / x, block_size, x], value [num_blocks,
  // num_kv_heads, head_size, block_size]); true = the flash layout (key and value
  // [num_blocks, block_size, num_kv_heads, head_size], what reshape_and_cache_flash writes).
  bool flash_layout;
  KvCacheDType cache_dtype;
  int64_t q_stride_seq;
  int64_t q_stride_head;
};

// Checks every argument of paged_attention_v1/v2 but the v2 scratch tensors.
PagedAttentionDims check_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
    const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,
    double k_scale, double v_scale);

// exp_sums / max_logits float32 [num_seqs, num_heads, P], tmp_out [num_seqs, num_heads, P,
// head_size] in the query dtype, P >= ceil(max_seq_len / 512). Returns P.
int64_t check_paged_attention_v2_scratch(
    const PagedAttentionDims& d, const at::Tensor& out, const at::Tensor& exp_sums,
    const at::Tensor& max_logits, const at::Tensor& tmp_out, int64_t max_seq_len);

// Every seq_len in [0, max_seq_len], and every block the sequence reads is in the table
// and names a block of the pool.
void check_paged_attention_values(
    const PagedAttentionDims& d, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    int64_t max_seq_len);

// varlen_paged_attention: query/out [num_tokens, num_heads, head_size], query_start_loc
// int32 [num_seqs + 1]; the rest as paged_attention (num_seqs = seq_lens' entries).
PagedAttentionDims check_varlen_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t block_size,
    int64_t max_query_len, int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
    const std::string& kv_cache_dtype, double k_scale, double v_scale);

// paged_attention's value checks, plus: query_start_loc starts at 0, ends at num_tokens and
// gives every sequence between 0 and min(max_query_len, seq_lens[i]) query tokens.
void check_varlen_paged_attention_values(const PagedAttentionDims& d,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc,
                                         int64_t max_query_len, int64_t max_seq_len);

// The shared part of both: seq_lens in [0, max_seq_len], block ids in the pool.
void check_attention_values(const char* op, const PagedAttentionDims& d,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            int64_t max_seq_len);

struct CacheWriteDims {
  const char* op;  // for messages: reshape_and_cache or reshape_and_cache_flash
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t x;  // paged layout only
  KvCacheDType cache_dtype;
  int64_t key_stride;    // between tokens, in elements
  int64_t value_stride;
};

// key/value [num_tokens, num_kv_heads, head_size] (rows may be strided, e.g. slices of a
// fused QKV tensor); caches in the paged (flash_layout=false) or flash layout.
CacheWriteDims check_reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const std::string& kv_cache_dtype, double k_scale, double v_scale, bool flash_layout);

// Every non-negative slot addresses the cache.
void check_slot_mapping_values(const CacheWriteDims& d, const at::Tensor& slot_mapping);

// Returns the number of blocks per cache; checks the mapping's values too.
int64_t check_copy_blocks(
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& block_mapping, bool check_values);

// Returns the bytes of one block; checks the mapping's values (it lives on the CPU).
int64_t check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                          const at::Tensor& block_mapping);

// int8_linear: x float32 or bfloat16 [..., K] (y in x's dtype); qweight int8 [N, K], or
// packed by pack_linear_weight [ceil(N / panel_cols), K, panel_cols], contiguous; scales
// float32 [N] (per row) or [N, K / G], G 32, 64 or 128 (groups, GGUF Q8_0), contiguous; bias
// float32 [N] contiguous or none; all on one device. Returns N.
int64_t check_int8_linear(const at::Tensor& x, const at::Tensor& qweight,
                          const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                          int64_t panel_cols);

// int4_linear: x float32 or bfloat16 [..., K] (y in x's dtype); qweight uint8 [N, K / 2], or
// packed [ceil(N / panel_cols), K / 2, panel_cols], contiguous; scales, zeros float32 [N, K /
// group_size] contiguous; group_size 32, 64 or 128 dividing K; bias float32 [N] or none; all
// on one device. Returns N.
int64_t check_int4_linear(const at::Tensor& x, const at::Tensor& qweight,
                          const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                          const std::optional<at::Tensor>& bias, int64_t panel_cols);

// pack_linear_weight: weight float32 or bfloat16 [N, K], N >= 1, K >= 1 (bfloat16: K even),
// or an int8_linear / int4_linear qweight (int8 [N, K] / uint8 [N, K / 2]), on the CPU.
void check_pack_linear_weight(const at::Tensor& weight);
// packed_linear: x float32 or bfloat16 [..., K]; packed_weight pack_linear_weight's of the
// same dtype (bfloat16 [panels, K / 2, panel columns, 2], float32 [panels, K, panel
// columns]) contiguous, out_features N with panels = ceil(N / panel columns); bias float32
// [N] contiguous or none; all on the CPU. gated (packed_gated_linear): out_features is
// the intermediate size I, with panels = ceil(I / (panel columns / 2)), and bias is
// [panels * panel columns] (the weight's column order).
void check_packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features,
                         int64_t panel_cols, bool gated = false);

// Element-wise ops of the decoder layer (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding). Float, half or bfloat16, every tensor of one op in one dtype (the
// rotary table may be float32) and on one device.
struct RowsDims {
  int64_t rows;
  int64_t hidden;      // the normalized width; silu_and_mul: the output width d
  int64_t row_stride;  // between the input's rows, in elements (the outputs are contiguous)
};

// input [..., hidden]: last dim contiguous, the leading dims collapse to one row stride;
// out contiguous, input's shape; weight [hidden] contiguous; epsilon finite and >= 0.
RowsDims check_rms_norm(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                        double epsilon);
// input, residual contiguous, one shape [..., hidden]; weight and epsilon as rms_norm.
RowsDims check_fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                  const at::Tensor& weight, double epsilon);
// input [..., 2 * d] with rows as rms_norm's input; out contiguous [..., d].
RowsDims check_silu_and_mul(const at::Tensor& out, const at::Tensor& input);
// greedy_sample: logits [rows, vocab] float, half or bfloat16, vocab in [1, 2^31) and
// contiguous within a row (any row stride); token_ids int64 [rows] and logprobs float32
// [rows] contiguous, on logits' device. hidden = vocab.
RowsDims check_greedy_sample(const at::Tensor& logits, const at::Tensor& token_ids,
                             const at::Tensor& logprobs);

// fused_moe: hidden [T, H] float32, float16 or bfloat16, contiguous; router_logits [T, E]
// float32, float16 or bfloat16, contiguous; w13 [E, 2I, H] and w2 [E, H, I] in hidden's
// dtype, contiguous, or (CPU only, packed_panel_cols > 0) both packed per expert by
// ops.pack_moe_weights: float32 w13 [E, ceil(I / (cols / 2)), H, cols] (gated panel order)
// and w2 [E, ceil(H / cols), I, cols]; bfloat16 the same with the K dimension halved and a
// trailing 2 (H and I even). 1 <= top_k <= min(E, kMoeMaxTopK), E <= kMoeMaxNumExperts; all
// on one device. packed_panel_cols: the CPU's packed panel width, 0 where packed weights are
// not accepted (CUDA).
struct MoeDims {
  int64_t tokens, hidden, experts, intermediate, top_k;
  bool packed;
};
MoeDims check_fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,
                        const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,
                        int64_t packed_panel_cols);

struct RotaryDims {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t rot_dim;       // the rotated leading dims of each head (cos_sin_cache's width)
  int64_t max_position;  // cos_sin_cache's rows
  int64_t q_stride;      // between tokens, in elements
  int64_t k_stride;
};

// positions int64 [num_tokens]; query [num_tokens, num_heads * head_size] or
// [num_tokens, num_heads, head_size] with heads contiguous within a token (any token
// stride), key likewise; cos_sin_cache [max_position, rot_dim] contiguous, float32 or the
// query dtype, rot_dim even and <= head_size.
RotaryDims check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                  const at::Tensor& key, int64_t head_size,
                                  const at::Tensor& cos_sin_cache, bool is_neox);
// Every position in [0, max_position) (reads the tensor).
void check_rotary_positions(const RotaryDims& d, const at::Tensor& positions);

}  // namespace vllm_lite
