// What the element-wise kernel builds (elementwise_kernel.h, one per ISA) and their caller
// (elementwise.cpp) share. Element types are attention_params.h's KvDType (float32,
// float16, bfloat16 only).
#pragma once

#include <cstdint>

#include "cpu/attention_params.h"

namespace vllm_lite::cpu {

// rms_norm, or fused_add_rms_norm when residual is set (then out == input, in place).
struct RmsNormArgs {
  KvDType dtype;
  const void* input;  // [rows, hidden], row stride input_row_stride
  void* residual;     // [rows, hidden] contiguous, or nullptr
  const void* weight;  // [hidden]
  void* out;           // [rows, hidden] contiguous
  int64_t hidden;
  int64_t input_row_stride;
  float epsilon;
};

struct SiluAndMulArgs {
  KvDType dtype;
  const void* input;  // [rows, 2 * d], row stride input_row_stride
  void* out;          // [rows, d] contiguous
  int64_t d;
  int64_t input_row_stride;
};

struct RotaryArgs {
  KvDType dtype;
  bool float_table;  // cos_sin_cache float32 (else dtype)
  bool is_neox;
  const int64_t* positions;  // [num_tokens], each in [0, max_position) (checked)
  void* query;               // [num_tokens, num_heads, head_size], token stride q_stride
  void* key;                 // [num_tokens, num_kv_heads, head_size], token stride k_stride
  const void* cos_sin_cache;  // [max_position, rot_dim]
  int64_t num_heads, num_kv_heads, head_size, rot_dim, q_stride, k_stride;
};

// greedy_sample: per row of logits, the lowest id among its maxima and that token's
// log_softmax; -1 and NaN for a row whose maximum is not finite (a NaN, +inf, or every
// logit -inf), which the caller samples another way.
struct GreedySampleArgs {
  KvDType dtype;
  const void* logits;  // [rows, vocab], row stride row_stride
  int64_t* token_ids;  // [rows]
  float* logprobs;     // [rows]
  int64_t vocab;       // < 2^31 (checked): lane indices are int32
  int64_t row_stride;
};

// Each runs rows (tokens) [r0, r1) of its op.
struct ElementwiseFns {
  void (*rms_norm)(const RmsNormArgs&, int64_t r0, int64_t r1);
  void (*silu_and_mul)(const SiluAndMulArgs&, int64_t r0, int64_t r1);
  void (*rotary)(const RotaryArgs&, int64_t r0, int64_t r1);
  void (*greedy_sample)(const GreedySampleArgs&, int64_t r0, int64_t r1);
};

// nullptr fns where a build was compiled out (non-x86 targets).
ElementwiseFns elementwise_generic();
ElementwiseFns elementwise_avx2();
ElementwiseFns elementwise_avx512();

}  // namespace vllm_lite::cpu
