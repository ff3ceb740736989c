// The cache ops are exact: every written element holds the source's bits, every other
// element keeps its own (NaN) bits.
#include <functional>
#include <limits>
#include <utility>

#include <vllm_lite/kernels.h>

#include "harness.h"
#include "reference.h"

namespace vt = vllm_lite::test;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Copies of the caches kc / vc after writing token i's key_of(i) / value_of(i) ([kvh, d],
// already in the cache's dtype) at slots[i]; negative slots are skipped.
std::pair<at::Tensor, at::Tensor> expected_caches(
    const at::Tensor& slots, const at::Tensor& kc, const at::Tensor& vc, bool flash,
    const std::function<at::Tensor(int64_t)>& key_of,
    const std::function<at::Tensor(int64_t)>& value_of) {
  auto ek = kc.clone(), ev = vc.clone();
  const int64_t bs = flash ? kc.size(1) : kc.size(3);
  const auto* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.size(0); ++i) {
    if (s[i] < 0) continue;
    const int64_t blk = s[i] / bs, off = s[i] % bs;
    const auto k = key_of(i), v = value_of(i);
    if (flash) {
      ek[blk][off].copy_(k);
      ev[blk][off].copy_(v);
    } else {
      ek[blk].select(2, off).copy_(k.view({kc.size(1), kc.size(2), kc.size(4)}));
      ev[blk].select(2, off).copy_(v);
    }
  }
  return {ek, ev};
}

// reshape_and_cache(_flash) of n tokens into NaN caches; slots are distinct, some negative.
void run_reshape_and_cache(bool flash, at::ScalarType dtype, double k_scale, double v_scale) {
  auto gen = vt::make_gen(flash ? 11 : 12);
  const int64_t n = 9, kvh = 2, d = 64, bs = 16, nb = 6, x = vt::elem_x(dtype);
  const auto key = at::randn({n, kvh, d}, gen).to(dtype);
  // Strided rows, as in a slice of a fused QKV projection.
  const auto value = at::randn({n, 3, kvh, d}, gen).to(dtype).select(1, 1);
  auto slots = at::randperm(nb * bs, gen, at::kLong).slice(0, 0, n).clone();
  slots.index_put_({at::tensor({1, 4, 8})}, at::tensor({-1L, -5L, -1L}));
  const auto k_shape = flash ? std::vector<int64_t>{nb, bs, kvh, d}
                             : std::vector<int64_t>{nb, kvh, d / x, bs, x};
  const auto v_shape = flash ? std::vector<int64_t>{nb, bs, kvh, d}
                             : std::vector<int64_t>{nb, kvh, d, bs};
  auto kc = at::full(k_shape, kNaN, dtype), vc = at::full(v_shape, kNaN, dtype);
  // Scales are powers of two, so key / k_scale is exact in every dtype.
  const auto [ek, ev] = expected_caches(
      slots, kc, vc, flash,
      [&](int64_t i) { return (key[i].to(at::kDouble) / k_scale).to(dtype); },
      [&](int64_t i) { return (value[i].to(at::kDouble) / v_scale).to(dtype); });
  const std::string what = std::string(flash ? "reshape_and_cache_flash " : "reshape_and_cache ") +
                           c10::toString(dtype);
  if (flash) {
    vllm_lite::reshape_and_cache_flash(key, value, kc, vc, slots, "auto", k_scale, v_scale);
  } else {
    vllm_lite::reshape_and_cache(key, value, kc, vc, slots, "auto", k_scale, v_scale);
  }
  vt::check_bitwise_equal(kc, ek, what + ": key_cache");
  vt::check_bitwise_equal(vc, ev, what + ": value_cache");
}

}  // namespace

VLLM_TEST(reshape_and_cache_exact) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    run_reshape_and_cache(false, dtype, 1.0, 1.0);
    run_reshape_and_cache(false, dtype, 2.0, 0.5);
  }
}

VLLM_TEST(reshape_and_cache_flash_exact) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    run_reshape_and_cache(true, dtype, 1.0, 1.0);
    run_reshape_and_cache(true, dtype, 0.5, 2.0);
  }
}

VLLM_TEST(copy_blocks_exact) {
  auto gen = vt::make_gen(21);
  const int64_t nb = 12;
  std::vector<at::Tensor> keys, values, ek, ev;
  for (auto dtype : {at::kHalf, at::kHalf}) {  // two layers
    keys.push_back(at::randn({nb, 2, 8, 16, 8}, gen).to(dtype));
    values.push_back(at::randn({nb, 2, 64, 16}, gen).to(dtype));
  }
  // Sources and destinations are disjoint (copy-on-write of shared blocks); 3 is copied twice.
  const auto mapping = at::tensor({3L, 7L, 3L, 0L, 10L, 5L, 1L, 11L}, at::kLong).view({4, 2});
  for (size_t l = 0; l < keys.size(); ++l) {
    ek.push_back(keys[l].clone());
    ev.push_back(values[l].clone());
    for (int64_t p = 0; p < mapping.size(0); ++p) {
      const int64_t src = mapping[p][0].item<int64_t>(), dst = mapping[p][1].item<int64_t>();
      ek[l][dst].copy_(keys[l][src]);
      ev[l][dst].copy_(values[l][src]);
    }
  }
  vllm_lite::copy_blocks(keys, values, mapping);
  for (size_t l = 0; l < keys.size(); ++l) {
    vt::check_bitwise_equal(keys[l], ek[l], "copy_blocks: key_caches[" + std::to_string(l) + "]");
    vt::check_bitwise_equal(values[l], ev[l],
                            "copy_blocks: value_caches[" + std::to_string(l) + "]");
  }
  // No pairs: nothing changes.
  vllm_lite::copy_blocks(keys, values, at::empty({0, 2}, at::kLong));
  vt::check_bitwise_equal(keys[0], ek[0], "copy_blocks with no pairs");
}

VLLM_TEST(swap_blocks_cpu) {
  auto gen = vt::make_gen(31);
  const auto src = at::randn({5, 2, 16, 8}, gen).to(at::kBFloat16);
  auto dst = at::full({9, 2, 16, 8}, kNaN, at::kBFloat16);
  const auto mapping = at::tensor({0L, 8L, 4L, 0L, 2L, 3L}, at::kLong).view({3, 2});
  auto expected = dst.clone();
  expected[8].copy_(src[0]);
  expected[0].copy_(src[4]);
  expected[3].copy_(src[2]);
  vllm_lite::swap_blocks(src, dst, mapping);
  vt::check_bitwise_equal(dst, expected, "swap_blocks");
}

namespace {

// An fp8 kv_cache_dtype: the caches are uint8 and hold ATen's float8 cast of the float32
// quotient key / k_scale, bit for bit; padding slots and the rest keep their bytes.
void run_reshape_and_cache_fp8(bool flash, const std::string& fmt, at::ScalarType fp8,
                               at::ScalarType dtype, double k_scale, double v_scale) {
  auto gen = vt::make_gen(flash ? 21 : 22);
  const int64_t n = 9, kvh = 2, d = 64, bs = 16, nb = 6, x = 16;
  // Values over many binades: subnormal to saturating after the scale.
  const auto key = (at::randn({n, kvh, d}, gen) *
                    at::exp2(at::randint(-14, 10, {n, kvh, d}, gen).to(at::kFloat)))
                       .to(dtype);
  const auto value = at::randn({n, 3, kvh, d}, gen).to(dtype).select(1, 1);
  auto slots = at::randperm(nb * bs, gen, at::kLong).slice(0, 0, n).clone();
  slots.index_put_({at::tensor({2, 5})}, at::tensor({-1L, -3L}));
  const auto k_shape = flash ? std::vector<int64_t>{nb, bs, kvh, d}
                             : std::vector<int64_t>{nb, kvh, d / x, bs, x};
  const auto v_shape = flash ? std::vector<int64_t>{nb, bs, kvh, d}
                             : std::vector<int64_t>{nb, kvh, d, bs};
  auto kc = at::full(k_shape, 0x7F, at::kByte), vc = at::full(v_shape, 0x7F, at::kByte);
  auto cast = [&](const at::Tensor& t, double scale) {
    return (t.to(at::kFloat) / at::scalar_tensor(scale, at::kFloat)).to(fp8).view(at::kByte);
  };
  const auto [ek, ev] = expected_caches(
      slots, kc, vc, flash, [&](int64_t i) { return cast(key[i], k_scale); },
      [&](int64_t i) { return cast(value[i], v_scale); });
  const std::string what = std::string(flash ? "reshape_and_cache_flash " : "reshape_and_cache ") +
                           fmt + " " + c10::toString(dtype);
  if (flash) {
    vllm_lite::reshape_and_cache_flash(key, value, kc, vc, slots, fmt, k_scale, v_scale);
  } else {
    vllm_lite::reshape_and_cache(key, value, kc, vc, slots, fmt, k_scale, v_scale);
  }
  vt::check_bitwise_equal(kc, ek, what + ": key_cache");
  vt::check_bitwise_equal(vc, ev, what + ": value_cache");
}

}  // namespace

VLLM_TEST(reshape_and_cache_fp8_matches_aten_casts) {
  for (bool flash : {false, true}) {
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      run_reshape_and_cache_fp8(flash, "fp8", at::kFloat8_e4m3fn, dtype, 1.0, 1.0);
      run_reshape_and_cache_fp8(flash, "fp8_e4m3", at::kFloat8_e4m3fn, dtype, 0.37, 2.5);
      run_reshape_and_cache_fp8(flash, "fp8_e5m2", at::kFloat8_e5m2, dtype, 1e-3, 30.0);
    }
  }
}

// Paged attention over fp8 caches equals the float64 reference on the dequantized cache
// (stored value x scale); the unused slots hold NaN bytes.
VLLM_TEST(paged_attention_fp8_matches_reference) {
  auto gen = vt::make_gen(23);
  const int64_t kvh = 2, group = 4, d = 64, bs = 16;
  for (const auto& [fmt, fp8] : {std::pair<std::string, at::ScalarType>{"fp8", at::kFloat8_e4m3fn},
                                 {"fp8_e5m2", at::kFloat8_e5m2}}) {
    auto kv = vt::make_paged_kv({37, 600, 1}, kvh, d, bs, at::kFloat, gen);
    const int64_t nb = kv.key_cache.size(0);
    // The float32 caches (x = 4) in the fp8 layout (x = 16), as bytes of value / scale.
    const double k_scale = 0.05, v_scale = 0.5;
    const auto rows = kv.key_cache.permute({0, 1, 3, 2, 4}).reshape({nb, kvh, bs, d});
    const auto k16 = rows.reshape({nb, kvh, bs, d / 16, 16}).permute({0, 1, 3, 2, 4}).contiguous();
    const auto k8 = (k16 / k_scale).to(fp8).view(at::kByte);
    const auto v8 = (kv.value_cache / v_scale).to(fp8).view(at::kByte);
    vt::PagedKV deq = kv;
    deq.key_cache = k8.view(fp8).to(at::kDouble) * k_scale;
    deq.value_cache = v8.view(fp8).to(at::kDouble) * v_scale;
    const auto query = at::randn({3, kvh * group, d}, gen);
    const double scale = 0.125;
    const auto expected = vt::ref_paged_attention(query, deq, scale, std::nullopt);
    auto out = at::full_like(query, kNaN);
    vllm_lite::paged_attention_v1(out, query, k8, v8, kvh, scale, kv.block_tables, kv.seq_lens,
                                  bs, 600, std::nullopt, fmt, k_scale, v_scale);
    vt::check_close(out, expected, at::kFloat, "paged_attention_v1 " + fmt);
  }
}
