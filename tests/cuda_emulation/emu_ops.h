// The CUDA ops' host-side launch logic, replayed on the SIMT emulator: each function
// mirrors its launcher in csrc/cuda (the argument checks are the Python tests' job) and
// launches the real kernels through cuda_emu::launch. Argument buffers are host memory.
#pragma once

#include <cstdint>

namespace emu_ops {

enum class DType { F32, F16, BF16 };
// What the caches hold (spec key "kv": auto | fp8_e4m3 | fp8_e5m2): the query dtype, or fp8
// bytes. The templates below take the query dtype T and the cache element CT (T, or
// vllm_lite::cuda::fp8_e4m3 / fp8_e5m2), as the kernels do.
enum class KvKind { Auto, Fp8E4M3, Fp8E5M2 };

struct AttentionArgs {
  int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int64_t max_blocks_per_seq, q_stride_seq, q_stride_head, max_seq_len;
  int64_t sms;  // multiprocessor count the launcher plans for
  int64_t cc;   // compute capability the launcher plans for (major * 10 + minor)
  int32_t* path_out;  // or nullptr: receives the DecodePath / VarlenPath the launch took
  double scale, k_scale, v_scale;
  const void* query;  // first element of the (possibly strided) query view
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // or nullptr
  bool flash_layout;          // caches [num_blocks, block_size, num_kv_heads, head_size]
};

// paged_attention_v1.cu: out [S, H, D].
template <typename T, typename CT>
void paged_attention_v1(const AttentionArgs& a, void* out);
// paged_attention_v2.cu: out [S, H, D], scratch of P partitions.
template <typename T, typename CT>
void paged_attention_v2(const AttentionArgs& a, void* out, float* exp_sums, float* max_logits,
                        void* tmp_out, int64_t num_partitions);

// varlen_attention.cu: out [num_tokens, H, D]. Query rows are tokens (q_stride_seq: between
// tokens); max_seq_len and sms are unused; cc picks the kernel as on such a GPU.
struct VarlenArgs : AttentionArgs {
  int64_t num_tokens, max_query_len;
  const int32_t* query_start_loc;
};
template <typename T, typename CT>
void varlen_paged_attention(const VarlenArgs& a, void* out);

struct CacheWriteArgs {
  int64_t num_tokens, num_kv_heads, head_size, block_size, num_blocks;
  int64_t key_stride, value_stride;  // elements between tokens
  double k_scale, v_scale;
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
};

// cache_kernels.cu: reshape_and_cache (flash = false) / reshape_and_cache_flash.
template <typename T, typename CT>
void reshape_and_cache(const CacheWriteArgs& a, bool flash);

// cache_kernels.cu: copy_blocks over `layers` layers; block_bytes per layer.
void copy_blocks(void* const* key_caches, void* const* value_caches,
                 const int64_t* block_bytes, int64_t layers, const int64_t* mapping,
                 int64_t pairs, int64_t num_blocks);

// cache_kernels.cu: swap_blocks (the copies; host memcpy for cudaMemcpyAsync) between a
// src of src_blocks and a dst of dst_blocks blocks. Returns the number of copies made.
int64_t swap_blocks(const void* src, void* dst, const int64_t* mapping, int64_t pairs,
                    int64_t block_bytes, int64_t src_blocks, int64_t dst_blocks);

}  // namespace emu_ops

// ---- element-wise ops (elementwise.cu; emu_elementwise.cpp)
namespace emu_ops {

// rms_norm / fused_add_rms_norm / silu_and_mul: rows of the input row_stride apart (the
// outputs, and fused_add's tensors, contiguous); hidden = silu_and_mul's output width d.
struct RowsArgs {
  int64_t rows, hidden, row_stride;
  double epsilon;
};
template <typename T>
void rms_norm(const RowsArgs& a, void* out, const void* input, const void* weight);
template <typename T>
void fused_add_rms_norm(const RowsArgs& a, void* input, void* residual, const void* weight);
template <typename T>
void silu_and_mul(const RowsArgs& a, void* out, const void* input);

struct RotaryArgs {
  int64_t num_tokens, num_heads, num_kv_heads, head_size, rot_dim, max_position;
  int64_t q_stride, k_stride;
  bool is_neox;
  const int64_t* positions;
  void* query;  // first element of each view
  void* key;
  const void* cos_sin_cache;
};
// CT: the table's element type (float or T).
template <typename T, typename CT>
void rotary_embedding(const RotaryArgs& a);

// fused_moe.cu: hidden [tokens, hidden] (T), router_logits [tokens, experts] (L: float or
// T), w13 [experts, 2 inter, hidden], w2 [experts, hidden, inter], out [tokens, hidden].
struct MoeArgs {
  int64_t tokens, hidden, experts, inter, top_k;
  int64_t cc;         // compute capability the launcher plans for (major * 10 + minor)
  int32_t* path_out;  // or nullptr: receives the MoePath the launch took
  bool renormalize;
  const void* hidden_states;
  const void* router_logits;
  const void* w13;
  const void* w2;
  void* out;
};
template <typename T, typename L>
void fused_moe(const MoeArgs& a);

}  // namespace emu_ops
