// llama_decode_layers: one decode step through a stack of Llama decoder layers in one call
// (CPU only), the CPU's counterpart of a CUDA graph. The model in Python makes ~10 module
// calls and ~9 op calls per layer; on the project's 2-core VM that serial Python and
// dispatch was a sixth of a bf16 throughput run's wall time, the second thread spinning
// meanwhile (README "Throughput"). This calls the same kernels in the same order as
// models/llama.py's layers with the same arguments, so the results are the same bits.
//
// Per layer l, 4 projections (qkv, o, gate_up, down): projection j = 4l + i runs
// packed_linear on weights[j] (a float weight packed by pack_linear_weight) where scales[j]
// is none, int8_linear where zeros[j] is none (per-channel or group scales), else
// int4_linear with group_sizes[j]; biases float32 or none. Per layer:
//   layer 0:      residual = hidden; hidden = rms_norm(residual)        (norm_weights[0])
//   later layers: fused_add_rms_norm(hidden, residual)                  (norm_weights[2l])
//   qkv = projection 4l (hidden)                                  [T, (H + 2 KVH) * D]
//   rotary_embedding on qkv's q and k columns (neox); reshape_and_cache(_flash) of k, v
//   attn_out = paged_attention v1, or v2 with the given scratch        [T, H, D]
//   hidden = projection 4l + 1 (attn_out)
//   fused_add_rms_norm(hidden, residual)                              (norm_weights[2l + 1])
//   hidden = projection 4l + 3 (silu_and_mul(projection 4l + 2 (hidden)))
//     with gated_mlp, projection 4l + 2 is a float weight packed gated, and
//     packed_gated_linear computes the silu_and_mul of it in one GEMM (the same bits)
// Returns the last layer's MLP output; residual (a buffer the caller owns, [T, hidden], its
// contents ignored) holds the stream before it. One token per sequence (T = number of sequences).
#include <ATen/ATen.h>

#include "ops.h"

namespace vllm_lite::cpu {
namespace {

// One projection of x to n columns, by the kind of its weight (see above).
at::Tensor project(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& zeros,
                   int64_t group_size, const std::optional<at::Tensor>& bias, int64_t n) {
  if (!scales.has_value()) return packed_linear(x, weight, bias, n);
  if (!zeros.has_value()) return int8_linear(x, weight, *scales, bias);
  return int4_linear(x, weight, *scales, *zeros, group_size, bias);
}

}  // namespace

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
    const std::optional<at::Tensor>& tmp_out, double epsilon) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(layers >= 1, "llama_decode_layers: no layers (key_caches is empty)");
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers,
              "llama_decode_layers: value_caches has ", value_caches.size(),
              " layers, key_caches ", layers);
  TORCH_CHECK(static_cast<int64_t>(norm_weights.size()) == 2 * layers,
              "llama_decode_layers: norm_weights must hold 2 per layer (", 2 * layers,
              "), got ", norm_weights.size());
  const std::pair<const char*, size_t> per_projection[] = {
      {"weights", weights.size()}, {"scales", scales.size()}, {"zeros", zeros.size()},
      {"group_sizes", group_sizes.size()}, {"biases", biases.size()}};
  for (const auto& [name, size] : per_projection) {
    TORCH_CHECK(static_cast<int64_t>(size) == 4 * layers, "llama_decode_layers: ", name,
                " must hold 4 per layer (", 4 * layers, "), got ", size);
  }
  TORCH_CHECK(hidden.dim() == 2 && residual.sizes() == hidden.sizes() &&
                  residual.scalar_type() == hidden.scalar_type(),
              "llama_decode_layers: hidden [T, hidden_size] and residual must match, got ",
              hidden.sizes(), " ", hidden.scalar_type(), " and ", residual.sizes(), " ",
              residual.scalar_type());
  TORCH_CHECK(attn_out.dim() == 3 && attn_out.size(0) == hidden.size(0),
              "llama_decode_layers: attn_out must be [T, num_heads, head_size] with T = ",
              hidden.size(0), ", got ", attn_out.sizes());
  for (int64_t l = 0; gated_mlp && l < layers; ++l) {
    TORCH_CHECK(!scales[4 * l + 2].has_value(), "llama_decode_layers: gated_mlp needs float "
                "gate_up weights (packed gated), but layer ", l, "'s has scales (quantized)");
  }
  const bool v2 = exp_sums.has_value();
  TORCH_CHECK(v2 == max_logits.has_value() && v2 == tmp_out.has_value(),
              "llama_decode_layers: exp_sums, max_logits and tmp_out (paged attention v2's "
              "scratch) must be given together");
  const int64_t T = hidden.size(0), width = hidden.size(1);
  const int64_t heads = attn_out.size(1), head_size = attn_out.size(2);
  const int64_t q_size = heads * head_size, kv_size = num_kv_heads * head_size;
  const std::optional<at::Tensor> no_alibi;

  const auto proj = [&](const at::Tensor& in, int64_t j, int64_t n) {
    return project(in, weights[j], scales[j], zeros[j], group_sizes[j], biases[j], n);
  };
  at::Tensor x = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    if (l == 0) {
      residual.copy_(x);
      rms_norm(x, residual, norm_weights[0], epsilon);
    } else {
      fused_add_rms_norm(x, residual, norm_weights[2 * l], epsilon);
    }
    const at::Tensor qkv = proj(x, 4 * l, q_size + 2 * kv_size);
    at::Tensor q = qkv.narrow(1, 0, q_size);
    at::Tensor k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_embedding(positions, q, k, head_size, cos_sin_cache, /*is_neox=*/true);
    at::Tensor k_cache = key_caches[l], v_cache = value_caches[l];
    // The caches' layout is the key cache's rank, as the attention kernels tell it.
    const auto write_kv = k_cache.dim() == 4 ? reshape_and_cache_flash : reshape_and_cache;
    write_kv(k.view({T, num_kv_heads, head_size}), v.view({T, num_kv_heads, head_size}), k_cache,
             v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale);
    const at::Tensor q3 = q.view({T, heads, head_size});
    if (v2) {
      at::Tensor es = *exp_sums, ml = *max_logits, to = *tmp_out;
      paged_attention_v2(attn_out, es, ml, to, q3, k_cache, v_cache, num_kv_heads, scale,
                         block_tables, seq_lens, block_size, max_seq_len, no_alibi,
                         kv_cache_dtype, k_scale, v_scale);
    } else {
      paged_attention_v1(attn_out, q3, k_cache, v_cache, num_kv_heads, scale, block_tables,
                         seq_lens, block_size, max_seq_len, no_alibi, kv_cache_dtype, k_scale,
                         v_scale);
    }
    x = proj(attn_out.view({T, q_size}), 4 * l + 1, width);
    fused_add_rms_norm(x, residual, norm_weights[2 * l + 1], epsilon);
    at::Tensor act;
    if (gated_mlp) {
      act = packed_gated_linear(x, weights[4 * l + 2], biases[4 * l + 2], intermediate_size);
    } else {
      const at::Tensor gate_up = proj(x, 4 * l + 2, 2 * intermediate_size);
      act = at::empty({T, intermediate_size}, gate_up.options());
      silu_and_mul(act, gate_up);
    }
    x = proj(act, 4 * l + 3, width);
  }
  return x;
}

}  // namespace vllm_lite::cpu
