// Invalid arguments throw c10::Error with csrc/validate.cpp's message and change nothing.
#include <limits>

#include <vllm_lite/kernels.h>

#include "harness.h"
#include "reference.h"

namespace vt = vllm_lite::test;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A valid paged_attention_v1 call (2 sequences, 4 heads over 2 KV heads, head size 64);
// tests change one argument.
struct Attn {
  at::Tensor out, query, key_cache, value_cache, block_tables, seq_lens;
  int64_t num_kv_heads = 2, block_size = 16, max_seq_len = 50;
  std::string kv_cache_dtype = "auto";
  double k_scale = 1.0;

  Attn() {
    auto gen = vt::make_gen(41);
    query = at::randn({2, 4, 64}, gen);
    out = at::full_like(query, kNaN);
    key_cache = at::randn({10, 2, 16, 16, 4}, gen);
    value_cache = at::randn({10, 2, 64, 16}, gen);
    block_tables = at::tensor({0, 1, 2, 3, 4, 5, 6, 7}, at::kInt).view({2, 4});
    seq_lens = at::tensor({50, 20}, at::kInt);
  }

  void v1() {
    vllm_lite::paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, 0.125,
                                  block_tables, seq_lens, block_size, max_seq_len, std::nullopt,
                                  kv_cache_dtype, k_scale, 1.0);
  }
};

// a.v1() throws with `substr` in the message and leaves out as it was.
#define TEST_CHECK_ATTN_ERROR(a, substr)                                  \
  do {                                                               \
    const auto before = (a).out.clone();                             \
    TEST_CHECK_THROWS_WITH((a).v1(), substr);                             \
    vt::check_bitwise_equal((a).out, before, "out after a rejected call"); \
  } while (0)

}  // namespace

VLLM_TEST(attention_valid_base_call_passes) {
  Attn a;
  a.v1();
  TEST_CHECK(!a.out.isnan().any().item<bool>());
}

VLLM_TEST(attention_errors) {
  {
    Attn a;
    a.kv_cache_dtype = "fp8_e4m3fnuz";
    TEST_CHECK_ATTN_ERROR(a, "paged_attention: kv_cache_dtype 'fp8_e4m3fnuz' is not supported");
  }
  {
    Attn a;  // an fp8 kv_cache_dtype needs uint8 caches
    a.kv_cache_dtype = "fp8";
    TEST_CHECK_ATTN_ERROR(a, "paged_attention: key_cache must be uint8 (Byte) for an fp8 "
                             "kv_cache_dtype");
  }
  {
    Attn a;
    a.k_scale = 0.0;
    TEST_CHECK_ATTN_ERROR(a, "k_scale and v_scale must be finite and positive");
  }
  {
    Attn a;  // 6 heads over 4 KV heads
    a.query = at::randn({2, 6, 64});
    a.out = at::full_like(a.query, kNaN);
    a.num_kv_heads = 4;
    a.key_cache = at::randn({10, 4, 16, 16, 4});
    a.value_cache = at::randn({10, 4, 64, 16});
    TEST_CHECK_ATTN_ERROR(a, "num_heads (6) must be a multiple of num_kv_heads (4)");
  }
  {
    Attn a;
    a.query = at::randn({2, 4, 12});
    a.out = at::full_like(a.query, kNaN);
    TEST_CHECK_ATTN_ERROR(a, "head_size must be a multiple of 8 in [8, 256], got 12");
  }
  {
    Attn a;
    a.block_tables = a.block_tables.to(at::kLong);
    TEST_CHECK_ATTN_ERROR(a, "block_tables must be Int, got Long");
  }
  {
    Attn a;
    a.block_tables[0][1] = 10;  // within sequence 0's 50 tokens
    TEST_CHECK_ATTN_ERROR(a, "outside the cache's 10 blocks");
  }
  {
    Attn a;
    a.seq_lens = at::tensor({60, 20}, at::kInt);
    TEST_CHECK_ATTN_ERROR(a, "is outside [0, max_seq_len=50]");
  }
  {
    Attn a;
    a.key_cache = a.key_cache.to(at::kHalf);
    TEST_CHECK_ATTN_ERROR(a, "key_cache must be Float for kv_cache_dtype 'auto', got Half");
  }
}

VLLM_TEST(cache_write_errors) {
  for (bool flash : {false, true}) {
    const std::string op = flash ? "reshape_and_cache_flash" : "reshape_and_cache";
    auto gen = vt::make_gen(51);
    const auto key = at::randn({5, 2, 64}, gen), value = at::randn({5, 2, 64}, gen);
    auto kc = flash ? at::full({10, 16, 2, 64}, kNaN) : at::full({10, 2, 16, 16, 4}, kNaN);
    auto vc = flash ? at::full({10, 16, 2, 64}, kNaN) : at::full({10, 2, 64, 16}, kNaN);
    const auto kc0 = kc.clone(), vc0 = vc.clone();
    auto call = [&](const at::Tensor& slots, const std::string& dtype) {
      if (flash) {
        vllm_lite::reshape_and_cache_flash(key, value, kc, vc, slots, dtype, 1.0, 1.0);
      } else {
        vllm_lite::reshape_and_cache(key, value, kc, vc, slots, dtype, 1.0, 1.0);
      }
    };
    const auto good = at::tensor({3L, -1L, 17L, 159L, 40L}, at::kLong);
    // Slot 160 is one past the cache; the valid slots before it are not written either.
    TEST_CHECK_THROWS_WITH(call(at::tensor({3L, -1L, 160L, 159L, 40L}, at::kLong), "auto"),
                      "slot_mapping holds slot 160 but the cache has only 160 slots "
                      "(10 blocks of 16)");
    TEST_CHECK_THROWS_WITH(call(good, "fp8_e4m3fnuz"),
                           op + ": kv_cache_dtype 'fp8_e4m3fnuz' is not supported");
    TEST_CHECK_THROWS_WITH(call(good, "fp8"),
                           op + ": key_cache must be uint8 (Byte) for an fp8 kv_cache_dtype");
    TEST_CHECK_THROWS_WITH(call(good.to(at::kInt), "auto"), op + ": slot_mapping must be Long, got Int");
    TEST_CHECK_THROWS_WITH(call(good.slice(0, 0, 4), "auto"),
                      op + ": slot_mapping has 4 entries but key has 5 tokens");
    vt::check_bitwise_equal(kc, kc0, op + ": key_cache after rejected calls");
    vt::check_bitwise_equal(vc, vc0, op + ": value_cache after rejected calls");
  }
}

VLLM_TEST(block_copy_errors) {
  std::vector<at::Tensor> keys{at::zeros({4, 2, 8})}, values{at::zeros({4, 2, 8})};
  TEST_CHECK_THROWS_WITH(
      vllm_lite::copy_blocks(keys, values, at::tensor({0L, 4L}, at::kLong).view({1, 2})),
      "copy_blocks: block_mapping holds block ids in [0, 4] but the caches have 4 blocks");
  TEST_CHECK_THROWS_WITH(vllm_lite::copy_blocks(keys, {}, at::zeros({1, 2}, at::kLong)),
                    "copy_blocks: got 1 key caches but 0 value caches");
  TEST_CHECK_THROWS_WITH(vllm_lite::copy_blocks(keys, values, at::zeros({1, 3}, at::kLong)),
                    "copy_blocks: block_mapping must be [num_pairs, 2]");

  const auto src = at::zeros({4, 2, 8});
  auto dst = at::zeros({3, 2, 8});
  TEST_CHECK_THROWS_WITH(
      vllm_lite::swap_blocks(src, dst, at::tensor({1L, 3L}, at::kLong).view({1, 2})),
      "swap_blocks: block_mapping[0, 1] = 3 is outside dst's 3 blocks");
  auto half = at::zeros({3, 2, 8}, at::kHalf);
  TEST_CHECK_THROWS_WITH(vllm_lite::swap_blocks(src, half, at::zeros({1, 2}, at::kLong)),
                    "swap_blocks: src is Float but dst is Half");
}

VLLM_TEST(cpu_isa_selection) {
  const auto isas = vllm_lite::cpu::cpu_isas();
  TEST_CHECK(!isas.empty() && isas.back() == "generic");
  TEST_CHECK_THROWS_WITH(vllm_lite::cpu::set_cpu_isa("sse9"), "CPU ISA 'sse9' is not available");
}
