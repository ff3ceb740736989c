// CPU rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding and greedy_sample:
// validation, the choice of kernel build (the CPU ISA switch of cpu_isa.h: AVX-512, AVX2
// or generic) and the split of rows over ATen's threads. The row kernels live in
// elementwise_kernel.h.
//
// These ops replace a decoder layer's chains of small torch ops (an RMSNorm alone is eight
// of them, each allocating and re-reading its input); at decode sizes that per-op overhead,
// not arithmetic, was the cost.
#include <algorithm>
#include <string>

#include <ATen/Parallel.h>

#include "cpu/cpu_isa.h"
#include "cpu/elementwise_params.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

// Rows per task: about this many elements, so decode-sized calls stay on one thread (a
// parallel region costs microseconds) and prefills use them all.
constexpr int64_t kElementsPerTask = 16384;

const ElementwiseFns& kernels() {
  static const ElementwiseFns avx512 = elementwise_avx512();
  static const ElementwiseFns avx2 = elementwise_avx2();
  static const ElementwiseFns generic = elementwise_generic();
  if (cpu_isa_includes("avx512") && avx512.rms_norm != nullptr) return avx512;
  if (cpu_isa_includes("avx2") && avx2.rms_norm != nullptr) return avx2;
  return generic;
}

KvDType elem_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDType::kFloat32;
    case at::kHalf: return KvDType::kFloat16;
    default: return KvDType::kBFloat16;  // validated: float, half or bfloat16
  }
}

template <typename Args, typename Fn>
void run_rows(Fn fn, const Args& a, int64_t rows, int64_t row_elems) {
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, row_elems));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { fn(a, r0, r1); });
}

void check_cpu(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), op, ": expected CPU tensors, got ", t.device());
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  const RowsDims d = check_rms_norm(out, input, weight, epsilon);
  check_cpu("rms_norm", input);
  if (d.rows == 0 || d.hidden == 0) return;
  const RmsNormArgs a{elem_type(input), input.data_ptr(), nullptr, weight.data_ptr(),
                      out.data_ptr(), d.hidden, d.row_stride, static_cast<float>(epsilon)};
  run_rows(kernels().rms_norm, a, d.rows, d.hidden);
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  const RowsDims d = check_fused_add_rms_norm(input, residual, weight, epsilon);
  check_cpu("fused_add_rms_norm", input);
  if (d.rows == 0 || d.hidden == 0) return;
  const RmsNormArgs a{elem_type(input), input.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                      input.data_ptr(), d.hidden, d.row_stride, static_cast<float>(epsilon)};
  run_rows(kernels().rms_norm, a, d.rows, d.hidden);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  const RowsDims d = check_silu_and_mul(out, input);
  check_cpu("silu_and_mul", input);
  if (d.rows == 0 || d.hidden == 0) return;
  const SiluAndMulArgs a{elem_type(input), input.data_ptr(), out.data_ptr(), d.hidden,
                         d.row_stride};
  run_rows(kernels().silu_and_mul, a, d.rows, 2 * d.hidden);
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const RotaryDims d =
      check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
  check_cpu("rotary_embedding", query);
  check_rotary_positions(d, positions);  // reading them costs nothing on the CPU
  if (d.num_tokens == 0) return;
  const RotaryArgs a{elem_type(query), cos_sin_cache.scalar_type() == at::kFloat, is_neox,
                     positions.data_ptr<int64_t>(), query.data_ptr(), key.data_ptr(),
                     cos_sin_cache.data_ptr(), d.num_heads, d.num_kv_heads, d.head_size,
                     d.rot_dim, d.q_stride, d.k_stride};
  run_rows(kernels().rotary, a, d.num_tokens, (d.num_heads + d.num_kv_heads) * d.rot_dim);
}

void greedy_sample(const at::Tensor& logits, at::Tensor& token_ids, at::Tensor& logprobs) {
  const RowsDims d = check_greedy_sample(logits, token_ids, logprobs);
  check_cpu("greedy_sample", logits);
  if (d.rows == 0) return;
  const GreedySampleArgs a{elem_type(logits), logits.data_ptr(), token_ids.data_ptr<int64_t>(),
                           logprobs.data_ptr<float>(), d.hidden, d.row_stride};
  run_rows(kernels().greedy_sample, a, d.rows, d.hidden);
}

}  // namespace vllm_lite::cpu
