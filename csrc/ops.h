// Every native op's C++ declaration, one place. Each op has one implementation per
// device: vllm_lite::cpu (csrc/cpu/) and vllm_lite::cuda (csrc/cuda/). The schemas
// that bind them to torch.ops.vllm_lite.* live in csrc/torch_bindings.cpp.
//
// Layouts (vLLM v0.6):
//   query, out      [num_seqs, num_heads, head_size]
//   key_cache       [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 bytes / element size
//   value_cache     [num_blocks, num_kv_heads, head_size, block_size]
//   flash layout    [num_blocks, block_size, num_kv_heads, head_size] (both K and V)
//   block_tables    int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]
//   slot_mapping    int64 [num_tokens], slot = block * block_size + offset, negative = padding
//   varlen query/out [num_tokens, num_heads, head_size], flat over sequences: sequence i's
//                   rows are query_start_loc[i] .. query_start_loc[i + 1] (int32 [num_seqs + 1]),
//                   its last new tokens, bottom-right causal over its seq_lens[i] context
//   v2 scratch      exp_sums, max_logits float32 [num_seqs, num_heads, max_num_partitions];
//                   tmp_out (query dtype) [num_seqs, num_heads, max_num_partitions, head_size]
//
// Element-wise ops of a decoder layer (vLLM v0.6's schemas; float, half, bfloat16; math in
// float32 with the rounding steps of Hugging Face's Llama, round_T = round to the tensor
// dtype, nearest even):
//   rms_norm            out = round_T(w * round_T(x * rsqrt(mean(x^2) + eps))) per row of
//                       input [..., hidden]
//   fused_add_rms_norm  residual = round_T(input + residual); input = rms_norm(residual)
//   silu_and_mul        input [..., 2d] = [gate | up]: out [..., d] = round_T(round_T(silu(gate)) * up)
//   rotary_embedding    in place on query [T, heads(, )head_size] / key (any token stride),
//                       table cos_sin_cache [max_position, rot_dim] = [cos | sin] (float32 or
//                       the query dtype, cast to it as HF does); is_neox pairs (i, i + rot/2),
//                       else (2i, 2i + 1): a' = round_T(round_T(a c) - round_T(b s)),
//                       b' = round_T(round_T(b c) + round_T(a s))
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "attention_limits.h"  // kPartitionSize, kMaxQueryHeadsPerKvHead, kMaxHeadSize

namespace vllm_lite {

#define VLLM_LITE_DECLARE_OPS                                                              \
  void paged_attention_v1(                                                                 \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,               \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,                   \
      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,      \
      int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,                  \
      const std::string& kv_cache_dtype, double k_scale, double v_scale);                  \
  void paged_attention_v2(                                                                 \
      at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,  \
      const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache, \
      int64_t num_kv_heads, double scale, const at::Tensor& block_tables,                  \
      const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,                 \
      const std::optional<at::Tensor>& alibi_slopes, const std::string& kv_cache_dtype,    \
      double k_scale, double v_scale);                                                     \
  void reshape_and_cache(                                                                  \
      const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,               \
      at::Tensor& value_cache, const at::Tensor& slot_mapping,                             \
      const std::string& kv_cache_dtype, double k_scale, double v_scale);                  \
  void reshape_and_cache_flash(                                                            \
      const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,               \
      at::Tensor& value_cache, const at::Tensor& slot_mapping,                             \
      const std::string& kv_cache_dtype, double k_scale, double v_scale);                  \
  void copy_blocks(                                                                        \
      const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches, \
      const at::Tensor& block_mapping);                                                    \
  void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping); \
  void varlen_paged_attention(                                                             \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,               \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,                   \
      const at::Tensor& block_tables, const at::Tensor& seq_lens,                          \
      const at::Tensor& query_start_loc, int64_t block_size, int64_t max_query_len,        \
      int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,                  \
      const std::string& kv_cache_dtype, double k_scale, double v_scale);                  \
  void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,        \
                double epsilon);                                                           \
  void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, \
                          double epsilon);                                                 \
  void silu_and_mul(at::Tensor& out, const at::Tensor& input);                             \
  void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,   \
                        int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox);

// fused_moe(hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], top_k,
// renormalize) -> [T, H] in hidden's dtype: a mixture-of-experts block (vllm_lite/layers/
// moe.py states the math and rounding; validate.h's check_fused_moe the arguments and the
// CPU's packed weight form, ops.pack_moe_weights). Limits: moe_limits.h. CPU:
// cpu/fused_moe.cpp; CUDA: cuda/moe/fused_moe.cu.
#define VLLM_LITE_DECLARE_MOE_OPS                                                           \
  at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,          \
                       const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,         \
                       bool renormalize);

namespace cpu {
VLLM_LITE_DECLARE_OPS
VLLM_LITE_DECLARE_MOE_OPS
// int8 weight-only linear (quantization="int8"): y = x @ (qweight * scales[:, None]).T + bias.
// CPU only; CUDA uses torch's _weight_int8pack_mm (vllm_lite/layers/quantization.py).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
// int4 weight-only linear (quantization="int4" / "gguf"): y = x @ w.T + bias with
// w[n, k] = q[n, k] * scales[n, k / group_size] + zeros[n, k / group_size], q unsigned 4-bit,
// two per byte of qweight [N, K / 2] (k = 2j in byte j's low nibble). CPU only.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size,
                       const std::optional<at::Tensor>& bias);
// float32 / bfloat16 linear on a packed weight (cpu/packed_linear_params.h):
// pack_linear_weight(W [N, K]) -> packed (bfloat16: K even; also int8_linear's int8 and
// int4_linear's uint8 qweight, for those ops' packed path); packed_linear(x [..., K] in
// W's dtype, packed, bias float32 [N] or none, N) -> x W^T + bias in x's dtype, accumulated
// in float32. The AVX-512 (float32) / AVX512-BF16 (bfloat16) / AVX2 (both) kernels where
// that CPU build is selected (packed_linear_kernel_selected), else the same math through
// at::linear on the unpacked weight. CPU only: models.llama.Linear uses it where the kernel is selected.
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features);
// packed_gated_linear(x [..., K], packed_weight, bias, I) -> [..., I]: silu(gate) * up of a
// SwiGLU MLP's gate and up projections in one GEMM, the same bits as silu_and_mul of
// packed_linear's [gate | up] output where the kernel runs. packed_weight:
// pack_linear_weight of the [2I, K] weight's rows put in gated panel order
// (ops.gated_panel_rows: per panel, kGatedPanelCols gate rows then the same outputs' up
// rows, zero rows past I); bias float32 in that order or none. CPU only; where
// packed_linear has no kernel, the same math through at::linear.
at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                               const std::optional<at::Tensor>& bias, int64_t intermediate_size);
bool packed_linear_kernel_selected(at::ScalarType dtype);
// Whether int8_linear / int4_linear run a packed qweight on packed_linear's tiles in the
// selected build (AVX-512 builds); elsewhere a packed qweight is unpacked per call, so the
// layers keep the row layout.
bool packed_quant_linear_kernel_selected();
// Greedy sampling: per row of logits [rows, vocab] (float, half or bfloat16), token_ids[r]
// = the lowest id among the row's maxima (torch.argmax) and logprobs[r] = its
// log_softmax in float32; -1 and NaN where the row's maximum is not finite (a NaN, +inf,
// or every logit -inf). CPU only: on the CPU it replaces a float32 copy, log_softmax and
// argmax over [rows, vocab], a visible share of a CPU decode step; on a GPU those are
// fast kernels, and the sampler keeps them (layers/sampler.py).
void greedy_sample(const at::Tensor& logits, at::Tensor& token_ids, at::Tensor& logprobs);
// One decode step through a stack of Llama decoder layers (the kernels above and below,
// called in models/llama.py's order; cpu/decode_layers.cpp states the layout).
// CPU only: LlamaModel uses it for decode steps when every layer qualifies.
at::Tensor llama_decode_layers(
    at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
    const std::vector<at::Tensor>& norm_weights, const std::vector<at::Tensor>& weights,
    const std::vector<std::optional<at::Tensor>>& scales,
    const std::vector<std::optional<at::Tensor>>& zeros, const std::vector<int64_t>& group_sizes,
    const std::vector<std::optional<at::Tensor>>& biases, int64_t intermediate_size, bool gated_mlp,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
    int64_t max_seq_len, int64_t num_kv_heads, double scale, const std::string& kv_cache_dtype,
    double k_scale, double v_scale, at::Tensor& attn_out,
    const std::optional<at::Tensor>& exp_sums, const std::optional<at::Tensor>& max_logits,
    const std::optional<at::Tensor>& tmp_out, double epsilon);
// Not an op: pack_linear_weight's inverse, the [N, K] weight (K bytes or K / 2 for int8 /
// int4) of a packed one, a copy; the fallbacks where no packed kernel is selected.
at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t N);
// Not an op: int8_linear's and int4_linear's GEMM on a packed qweight (packed_linear.cpp),
// x2 [M, K] float32 or bfloat16 with rows contiguous within themselves, y = scale * (x2 W^T)
// + bias with W dequantized from qw (scale: [N] or nullptr); an undefined tensor where the
// selected CPU build has no packed kernel for x2's dtype.
struct PackedQuantWeight;
at::Tensor packed_quant_linear(const at::Tensor& x2, const PackedQuantWeight& qw, int64_t N,
                               const float* scale, const std::optional<at::Tensor>& bias);

// Binds torch's OpenMP threads one per CPU of cpu_ids ("0-3,8"); cpu/threads.cpp.
std::string init_cpu_threads_env(const std::string& cpu_ids);
}  // namespace cpu

namespace cuda {
VLLM_LITE_DECLARE_OPS
VLLM_LITE_DECLARE_MOE_OPS
}  // namespace cuda

#undef VLLM_LITE_DECLARE_OPS
#undef VLLM_LITE_DECLARE_MOE_OPS

}  // namespace vllm_lite
