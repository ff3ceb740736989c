// The plain-data interface between the CPU attention entry points (attention.cpp, which
// sees torch) and the per-ISA kernel builds (attention_<isa>.cpp, which must not: each is
// compiled for its own instruction set, and a torch inline function emitted there could be
// picked by the linker for the whole library).
#pragma once

#include <cstdint>

namespace vllm_lite::cpu {

// Element types of the query and of the caches. The fp8 ones (OCP e4m3fn: bias 7, no
// infinities, S.1111.111 = NaN; e5m2: IEEE-style, bias 15) are cache types only, stored as
// uint8 as in vLLM; the query is always one of the first three.
enum class KvDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

struct AttentionParams {
  KvDType q_dtype;      // query
  KvDType cache_dtype;  // key_cache / value_cache: q_dtype, or fp8 ("fp8*" kv_cache_dtype)
  const void* query;  // [num_seqs, num_heads, head_size] with the strides below
  int64_t q_stride_seq;
  int64_t q_stride_head;
  // Split layout: key [num_blocks, num_kv_heads, head_size / x, block_size, x], value
  // [num_blocks, num_kv_heads, head_size, block_size]. Flash layout (flash_layout): both
  // [num_blocks, block_size, num_kv_heads, head_size].
  const void* key_cache;
  const void* value_cache;
  bool flash_layout;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;      // [num_seqs]
  const float* alibi_slopes;    // [num_heads] or null
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  float scale;    // softmax scale times k_scale (the cache holds key / k_scale)
  float v_scale;  // the cache holds value / v_scale
  int64_t partition_size;
  int64_t num_partitions;  // partition slots per (seq, head) in the outputs below
  // Per (seq, head, partition): the partition's max logit, sum of exp(logit - max), and its
  // output normalized by that sum (times v_scale). Partitions past a sequence's end are
  // not written.
  float* part_max;  // [num_seqs, num_heads, num_partitions]
  float* part_sum;  // [num_seqs, num_heads, num_partitions]
  float* part_out;  // [num_seqs, num_heads, num_partitions, head_size]
};

// varlen_paged_attention (prefill over the paged cache). Tokens of the KV context per step
// of the online softmax: the task converts that many keys and values to float32 once and
// reuses them for all its query rows. A multiple of 64 (four vectors of the widest build).
constexpr int64_t kVarlenKvChunk = 128;
// Query rows (query tokens x query heads of one KV head) per task, at most: a task serves
// max(1, kVarlenRows / group) query tokens, so its rows' queries and accumulators stay in
// L1/L2 and K/V converted once feed ~64 rows.
constexpr int64_t kVarlenRows = 64;

struct VarlenParams {
  KvDType q_dtype;
  KvDType cache_dtype;
  const void* query;  // [num_tokens, num_heads, head_size] with the strides below
  int64_t q_stride_token;
  int64_t q_stride_head;
  const void* key_cache;    // as AttentionParams
  const void* value_cache;
  bool flash_layout;
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;         // [num_seqs], context including the new tokens
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const float* alibi_slopes;       // [num_heads] or null
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  float scale;    // softmax scale times k_scale
  float v_scale;
  int64_t query_tile;  // query tokens per task
  // The tasks' query tiles: sequence and first query token (within the sequence) of tile
  // i; task = tile * num_kv_heads + KV head.
  const int32_t* tile_seq;
  const int32_t* tile_start;
  int64_t num_tiles;
  // [num_tokens, num_heads, head_size], contiguous: float32 (out), or bfloat16 bits
  // (out_bf16, rounded to nearest even as torch's cast) where that is not null.
  float* out;
  uint16_t* out_bf16;
};

// Where the tile of one (block, KV head) lies in either cache layout, in elements: its
// offset from the block's start, and the distance between its tokens' rows of head_size
// elements in the flash layout (in the split layout the tile is one contiguous run of
// head_size x block_size elements).
inline int64_t kv_head_offset(bool flash, int64_t kh, int64_t head_size, int64_t block_size) {
  return flash ? kh * head_size : kh * head_size * block_size;
}
inline int64_t kv_flash_token_stride(int64_t num_kv_heads, int64_t head_size) {
  return num_kv_heads * head_size;
}

// Requests a (block, KV head) tile into the outer caches (locality 1; see
// attention_kernel.h's prefetch_tile): contiguous in the split layout, block_size rows of
// head_size elements in the flash layout. tile points at the tile's first element.
inline void prefetch_kv_tile(const void* tile, bool flash, int64_t head_size, int64_t block_size,
                             int64_t num_kv_heads, int64_t elem_bytes) {
  const char* c = static_cast<const char*>(tile);
  if (!flash) {
    const int64_t bytes = head_size * block_size * elem_bytes;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
    return;
  }
  const int64_t row = head_size * elem_bytes;
  const int64_t stride = num_kv_heads * row;
  for (int64_t t = 0; t < block_size; ++t, c += stride) {
    for (int64_t i = 0; i < row; i += 64) __builtin_prefetch(c + i, 0, 1);
    __builtin_prefetch(c + row - 1, 0, 1);  // a row need not start on a cache line
  }
}

// Query rows of a task padded to whole vectors of any build (16 floats): the kernel keeps
// rows across the vector lanes.
inline int64_t varlen_rows_padded(const VarlenParams& p) {
  const int64_t rows = p.query_tile * (p.num_heads / p.num_kv_heads);
  return (rows + 15) / 16 * 16;
}

// Head size rounded up to a multiple of 16, so dot products need no tail loop at any
// vector width.
inline int64_t padded_head_size(int64_t head_size) { return (head_size + 15) / 16 * 16; }

// Floats of per-thread scratch one task needs: q [group, padded head] | k [padded head] |
// logits [group, partition]; the AVX512-BF16 task instead keeps logits | the query chunks
// repeated 4x in bf16 [group, head / 8, 32] | probabilities in bf16 [group, partition],
// which fits in the same size plus 2 x group x padded head. After both, the float32 task's
// query repeated for its token-vector K pass: at most 4 copies (a vector holds at least 4 of
// a token's dims) [group, 4 x padded head]. The caller aligns it to 64 bytes.
inline int64_t attention_scratch_floats(const AttentionParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t dp = padded_head_size(p.head_size);
  return group * dp + dp + 2 * group * p.partition_size + 2 * group * dp + 4 * group * dp;
}

// Floats of per-thread scratch one varlen task needs (rp = varlen_rows_padded):
// q^T [Dp, rp] | K [chunk, Dp] | V [Dp, chunk] | P^T [chunk, rp] | acc^T [Dp, rp] |
// max, sum, rescale, position [rp] | one query row [Dp].
inline int64_t varlen_scratch_floats(const VarlenParams& p) {
  const int64_t rp = varlen_rows_padded(p);
  const int64_t dp = padded_head_size(p.head_size);
  return 2 * dp * rp + 2 * kVarlenKvChunk * dp + kVarlenKvChunk * rp + 4 * rp + dp;
}

// One task: sequence s, KV head kh, partition part, for all the query heads of kh.
// Task index = (s * num_kv_heads + kh) * num_partitions + part.
using AttentionTaskFn = void (*)(const AttentionParams& p, int64_t task, float* scratch);

// Each ISA build defines its function; a build compiled without that ISA returns null.
AttentionTaskFn attention_task_generic();
AttentionTaskFn attention_task_avx2();
AttentionTaskFn attention_task_avx512();
AttentionTaskFn attention_task_avx512bf16();

// One varlen task: query tile task / num_kv_heads, KV head task % num_kv_heads.
using VarlenTaskFn = void (*)(const VarlenParams& p, int64_t task, float* scratch);
VarlenTaskFn varlen_task_generic();
VarlenTaskFn varlen_task_avx2();
VarlenTaskFn varlen_task_avx512();
VarlenTaskFn varlen_task_avx512bf16();
// The build cpu_isa() names (attention.cpp selects it): its varlen kernel.
VarlenTaskFn selected_varlen_task();

}  // namespace vllm_lite::cpu
