// CPU paged attention v1 / v2 through the public API against the naive float64 reference:
// random block tables over a shuffled pool, GQA and MQA, NaN in every unused cache slot
// and in out and the v2 scratch, every CPU ISA build this machine runs.
#include <cmath>
#include <limits>
#include <sstream>

#include <vllm_lite/kernels.h>

#include "harness.h"
#include "reference.h"

namespace vt = vllm_lite::test;

namespace {

struct Case {
  at::ScalarType dtype;
  int64_t num_heads, num_kv_heads, head_size, block_size;
  std::vector<int> seq_lens;
  bool alibi = false;
};

std::vector<Case> cases() {
  return {
      {at::kFloat, 8, 2, 64, 16, {1, 17, 0, 300, 1100}},
      {at::kHalf, 8, 2, 128, 32, {33, 700, 5}},
      {at::kBFloat16, 8, 2, 80, 16, {64, 1, 530}},
      {at::kFloat, 4, 1, 256, 8, {9, 129}},         // MQA
      {at::kHalf, 4, 4, 64, 16, {100, 20}, true},  // ALiBi
  };
}

std::string describe(const Case& c, const std::string& isa) {
  std::ostringstream s;
  s << c10::toString(c.dtype) << " heads=" << c.num_heads << "/" << c.num_kv_heads
    << " head_size=" << c.head_size << " block_size=" << c.block_size
    << (c.alibi ? " alibi" : "") << " isa=" << isa;
  return s.str();
}

at::Tensor nan_like(const at::Tensor& t) {
  return at::full_like(t, std::numeric_limits<double>::quiet_NaN());
}

// Runs every case on every ISA build; v2 when `v2`, else v1.
void run_attention(bool v2) {
  const auto isas = vllm_lite::cpu::cpu_isas();
  const auto saved = vllm_lite::cpu::cpu_isa();
  uint64_t seed = v2 ? 1000 : 0;
  for (const auto& c : cases()) {
    auto gen = vt::make_gen(++seed);
    const auto kv = vt::make_paged_kv(c.seq_lens, c.num_kv_heads, c.head_size, c.block_size,
                                      c.dtype, gen);
    const int64_t num_seqs = static_cast<int64_t>(c.seq_lens.size());
    const auto query = at::randn({num_seqs, c.num_heads, c.head_size}, gen).to(c.dtype);
    const int64_t max_seq_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_size));
    std::optional<at::Tensor> alibi;
    if (c.alibi) alibi = at::linspace(-0.5, 0.25, c.num_heads, at::kFloat);
    const auto expected = vt::ref_paged_attention(query, kv, scale, alibi);

    for (const auto& isa : isas) {
      vllm_lite::cpu::set_cpu_isa(isa);
      auto out = nan_like(query);
      if (v2) {
        const int64_t parts = std::max<int64_t>(
            1, (max_seq_len + vllm_lite::kPartitionSize - 1) / vllm_lite::kPartitionSize);
        auto exp_sums = nan_like(at::empty({num_seqs, c.num_heads, parts}, at::kFloat));
        auto max_logits = nan_like(exp_sums);
        auto tmp_out = nan_like(at::empty({num_seqs, c.num_heads, parts, c.head_size}, c.dtype));
        vllm_lite::paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, kv.key_cache,
                                      kv.value_cache, c.num_kv_heads, scale, kv.block_tables,
                                      kv.seq_lens, c.block_size, max_seq_len, alibi, "auto",
                                      1.0, 1.0);
      } else {
        vllm_lite::paged_attention_v1(out, query, kv.key_cache, kv.value_cache, c.num_kv_heads,
                                      scale, kv.block_tables, kv.seq_lens, c.block_size,
                                      max_seq_len, alibi, "auto", 1.0, 1.0);
      }
      vt::check_close(out, expected, c.dtype,
                      std::string(v2 ? "paged_attention_v2 " : "paged_attention_v1 ") +
                          describe(c, isa));
    }
  }
  vllm_lite::cpu::set_cpu_isa(saved);
}

}  // namespace

VLLM_TEST(paged_attention_v1_matches_reference) { run_attention(false); }

VLLM_TEST(paged_attention_v2_matches_reference) { run_attention(true); }

// The per-device function of ops.h gives the dispatcher's result bit for bit.
VLLM_TEST(paged_attention_cpu_function_matches_dispatcher) {
  auto gen = vt::make_gen(7);
  const auto kv = vt::make_paged_kv({40, 3}, 2, 64, 16, at::kFloat, gen);
  const auto query = at::randn({2, 4, 64}, gen);
  auto a = nan_like(query), b = nan_like(query);
  vllm_lite::paged_attention_v1(a, query, kv.key_cache, kv.value_cache, 2, 0.125,
                                kv.block_tables, kv.seq_lens, 16, 40, std::nullopt, "auto",
                                1.0, 1.0);
  vllm_lite::cpu::paged_attention_v1(b, query, kv.key_cache, kv.value_cache, 2, 0.125,
                                     kv.block_tables, kv.seq_lens, 16, 40, std::nullopt,
                                     "auto", 1.0, 1.0);
  vt::check_bitwise_equal(a, b, "dispatcher vs vllm_lite::cpu::paged_attention_v1");
}

// Linking vllm_lite::kernels registers the six schemas with a CPU kernel each, and a CUDA
// kernel exactly when the library was built with the CUDA kernels.
VLLM_TEST(ops_registered_with_dispatcher) {
  for (const char* name : {"paged_attention_v1", "paged_attention_v2", "reshape_and_cache",
                           "reshape_and_cache_flash", "copy_blocks", "swap_blocks"}) {
    const std::string full = std::string("vllm_lite::") + name;
    const auto op = c10::Dispatcher::singleton().findSchema({full.c_str(), ""});
    TEST_CHECK_MSG(op.has_value(), full << " is not registered");
    TEST_CHECK_MSG(op->hasKernelForDispatchKey(c10::DispatchKey::CPU), full << " has no CPU kernel");
    TEST_CHECK_MSG(op->hasKernelForDispatchKey(c10::DispatchKey::CUDA) == bool(VLLM_LITE_CUDA_KERNELS),
              full << ": CUDA kernel registered != VLLM_LITE_CUDA_KERNELS");
  }
}
