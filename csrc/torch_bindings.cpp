// Every schema of torch.ops.vllm_lite, and the registration of each op's CPU and CUDA
// implementation. Schemas and argument order follow vLLM v0.6 (without its block-sparse
// arguments), so code that calls torch.ops._C.* can switch namespaces.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_lite, m) {
  m.def(
      "paged_attention_v1(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "int num_kv_heads, float scale, Tensor block_tables, Tensor seq_lens, int block_size, "
      "int max_seq_len, Tensor? alibi_slopes, str kv_cache_dtype, float k_scale, "
      "float v_scale) -> ()");
  m.def(
      "paged_attention_v2(Tensor! out, Tensor! exp_sums, Tensor! max_logits, Tensor! tmp_out, "
      "Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, float scale, "
      "Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len, "
      "Tensor? alibi_slopes, str kv_cache_dtype, float k_scale, float v_scale) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, float k_scale, float v_scale) -> ()");
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor! key_cache, "
      "Tensor! value_cache, Tensor slot_mapping, str kv_cache_dtype, float k_scale, "
      "float v_scale) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor! dst, Tensor block_mapping) -> ()");
  // Prefill over the paged cache (vllm_lite's own; vLLM v0.6 has no such op).
  m.def(
      "varlen_paged_attention(Tensor! out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, int num_kv_heads, float scale, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, int block_size, int max_query_len, "
      "int max_seq_len, Tensor? alibi_slopes, str kv_cache_dtype, float k_scale, "
      "float v_scale) -> ()");
  // Element-wise ops of a decoder layer (vLLM v0.6 schemas; ops.h gives their rounding).
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()");
  m.def("silu_and_mul(Tensor! out, Tensor input) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor! key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def(
      "int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
      "Tensor? bias) -> Tensor");
  m.def("greedy_sample(Tensor logits, Tensor! token_ids, Tensor! logprobs) -> ()");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def(
      "packed_gated_linear(Tensor x, Tensor packed_weight, Tensor? bias, int intermediate_size) "
      "-> Tensor");
  m.def(
      "llama_decode_layers(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, "
      "Tensor[] norm_weights, Tensor[] weights, Tensor?[] scales, "
      "Tensor?[] zeros, int[] group_sizes, Tensor?[] biases, "
      "int intermediate_size, bool gated_mlp, Tensor(c!)[] key_caches, Tensor(d!)[] value_caches, "
      "Tensor cos_sin_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "int block_size, int max_seq_len, int num_kv_heads, float scale, str kv_cache_dtype, "
      "float k_scale, float v_scale, Tensor(e!) attn_out, Tensor(f!)? exp_sums, "
      "Tensor(g!)? max_logits, Tensor(h!)? tmp_out, float epsilon) -> Tensor");
  // A mixture-of-experts block (ops.h); w13 / w2 may be packed on the CPU (pack_moe_weights).
  m.def(
      "fused_moe(Tensor hidden, Tensor router_logits, Tensor w13, Tensor w2, int top_k, "
      "bool renormalize) -> Tensor");
  // No tensors: one implementation for every backend (vLLM v0.6's CPU schema).
  m.def("init_cpu_threads_env(str cpu_ids) -> str", &vllm_lite::cpu::init_cpu_threads_env);
}

#define VLLM_LITE_REGISTER_IMPLS(ns)                                 \
  m.impl("paged_attention_v1", &vllm_lite::ns::paged_attention_v1); \
  m.impl("paged_attention_v2", &vllm_lite::ns::paged_attention_v2); \
  m.impl("reshape_and_cache", &vllm_lite::ns::reshape_and_cache);   \
  m.impl("reshape_and_cache_flash", &vllm_lite::ns::reshape_and_cache_flash); \
  m.impl("copy_blocks", &vllm_lite::ns::copy_blocks);               \
  m.impl("swap_blocks", &vllm_lite::ns::swap_blocks);               \
  m.impl("varlen_paged_attention", &vllm_lite::ns::varlen_paged_attention); \
  m.impl("rms_norm", &vllm_lite::ns::rms_norm);                     \
  m.impl("fused_add_rms_norm", &vllm_lite::ns::fused_add_rms_norm); \
  m.impl("silu_and_mul", &vllm_lite::ns::silu_and_mul);             \
  m.impl("rotary_embedding", &vllm_lite::ns::rotary_embedding);     \
  m.impl("fused_moe", &vllm_lite::ns::fused_moe);

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  VLLM_LITE_REGISTER_IMPLS(cpu)
  m.impl("int8_linear", &vllm_lite::cpu::int8_linear);  // CPU only (ops.h)
  m.impl("int4_linear", &vllm_lite::cpu::int4_linear);  // CPU only (ops.h)
  m.impl("pack_linear_weight", &vllm_lite::cpu::pack_linear_weight);  // CPU only (ops.h)
  m.impl("packed_linear", &vllm_lite::cpu::packed_linear);            // CPU only (ops.h)
  m.impl("packed_gated_linear", &vllm_lite::cpu::packed_gated_linear);  // CPU only (ops.h)
  m.impl("llama_decode_layers", &vllm_lite::cpu::llama_decode_layers);  // CPU only (ops.h)
  m.impl("greedy_sample", &vllm_lite::cpu::greedy_sample);              // CPU only (ops.h)
}

#ifdef VLLM_LITE_WITH_CUDA
TORCH_LIBRARY_IMPL(vllm_lite, CUDA, m) { VLLM_LITE_REGISTER_IMPLS(cuda) }
#endif

