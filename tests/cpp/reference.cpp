#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>

#include "harness.h"

namespace vllm_lite::test {

at::Generator make_gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

int64_t elem_x(at::ScalarType dtype) { return 16 / static_cast<int64_t>(c10::elementSize(dtype)); }

PagedKV make_paged_kv(const std::vector<int>& seq_lens, int64_t num_kv_heads,
                      int64_t head_size, int64_t block_size, at::ScalarType dtype,
                      at::Generator& gen) {
  std::vector<int64_t> need;
  int64_t total = 0, cols = 1;
  for (int n : seq_lens) {
    need.push_back((n + block_size - 1) / block_size);
    total += need.back();
    cols = std::max(cols, need.back());
  }
  const int64_t num_blocks = total + std::max<int64_t>(2, total / 3);
  const int64_t x = elem_x(dtype);
  auto kc = at::randn({num_blocks, num_kv_heads, head_size / x, block_size, x}, gen);
  auto vc = at::randn({num_blocks, num_kv_heads, head_size, block_size}, gen);

  const auto perm = at::randperm(num_blocks, gen, at::kLong);
  const int64_t* ids = perm.data_ptr<int64_t>();
  const int64_t spare = num_blocks - total;
  auto tables = at::empty({static_cast<int64_t>(seq_lens.size()), cols}, at::kInt);
  auto used = at::zeros({num_blocks, block_size}, at::kBool);
  auto t = tables.accessor<int32_t, 2>();
  auto u = used.accessor<bool, 2>();
  int64_t pos = 0;
  for (size_t s = 0; s < seq_lens.size(); ++s) {
    for (int64_t b = 0; b < cols; ++b) {
      if (b < need[s]) {
        const int64_t blk = ids[pos++];
        t[s][b] = static_cast<int32_t>(blk);
        for (int64_t o = 0; o < std::min(block_size, seq_lens[s] - b * block_size); ++o) {
          u[blk][o] = true;
        }
      } else {  // a NaN-filled spare block
        t[s][b] = static_cast<int32_t>(ids[total + (s * 7 + b) % spare]);
      }
    }
  }
  const auto unused = used.logical_not();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  kc.permute({0, 3, 1, 2, 4}).index_put_({unused}, nan);
  vc.permute({0, 3, 1, 2}).index_put_({unused}, nan);
  return PagedKV{kc.to(dtype), vc.to(dtype), tables,
                 at::tensor(std::vector<int32_t>(seq_lens.begin(), seq_lens.end()), at::kInt),
                 block_size, num_kv_heads, head_size};
}

at::Tensor ref_paged_attention(const at::Tensor& query, const PagedKV& kv, double scale,
                               const std::optional<at::Tensor>& alibi_slopes) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), d = query.size(2);
  const int64_t group = num_heads / kv.num_kv_heads, bs = kv.block_size;
  const int64_t x = kv.key_cache.size(4);
  const auto q64 = query.to(at::kDouble).contiguous();
  const auto k64 = kv.key_cache.to(at::kDouble).contiguous();
  const auto v64 = kv.value_cache.to(at::kDouble).contiguous();
  const auto q = q64.accessor<double, 3>();
  const auto k = k64.accessor<double, 5>();
  const auto v = v64.accessor<double, 4>();
  const auto table = kv.block_tables.accessor<int32_t, 2>();
  const auto lens = kv.seq_lens.accessor<int32_t, 1>();
  std::vector<double> slopes;
  if (alibi_slopes) {
    const auto a = alibi_slopes->to(at::kDouble).contiguous();
    slopes.assign(a.data_ptr<double>(), a.data_ptr<double>() + num_heads);
  }
  auto out = at::zeros({num_seqs, num_heads, d}, at::kDouble);
  auto o = out.accessor<double, 3>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    if (len == 0) continue;
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kh = h / group;
      std::vector<double> logits(len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = table[s][t / bs], off = t % bs;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += q[s][h][i] * k[blk][kh][i / x][off][i % x];
        logits[t] = scale * dot + (slopes.empty() ? 0.0 : slopes[h] * double(t - len + 1));
      }
      const double m = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (auto& l : logits) sum += (l = std::exp(l - m));
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = table[s][t / bs], off = t % bs;
        for (int64_t i = 0; i < d; ++i) o[s][h][i] += logits[t] / sum * v[blk][kh][i][off];
      }
    }
  }
  return out;
}

void check_close(const at::Tensor& actual, const at::Tensor& expected, at::ScalarType dtype,
                 const std::string& what) {
  double atol = 1e-4, rtol = 1e-4;
  if (dtype == at::kHalf) atol = rtol = 2e-3;
  if (dtype == at::kBFloat16) atol = rtol = 1.6e-2;
  TEST_CHECK_MSG(actual.sizes() == expected.sizes(),
            what << ": shape " << actual.sizes() << " != " << expected.sizes());
  const auto a = actual.to(at::kDouble).contiguous();
  const auto e = expected.to(at::kDouble).contiguous();
  const double* pa = a.data_ptr<double>();
  const double* pe = e.data_ptr<double>();
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (!(std::abs(pa[i] - pe[i]) <= atol + rtol * std::abs(pe[i]))) {
      if (bad++ == 0) first = i;
    }
  }
  TEST_CHECK_MSG(bad == 0, what << " (" << c10::toString(dtype) << "): " << bad << " of "
                           << a.numel() << " elements differ; first at flat index " << first
                           << ": got " << pa[first] << ", expected " << pe[first]);
}

void check_bitwise_equal(const at::Tensor& actual, const at::Tensor& expected,
                         const std::string& what) {
  TEST_CHECK_MSG(actual.sizes() == expected.sizes(),
            what << ": shape " << actual.sizes() << " != " << expected.sizes());
  TEST_CHECK_MSG(actual.scalar_type() == expected.scalar_type(),
            what << ": dtype " << actual.scalar_type() << " != " << expected.scalar_type());
  const auto a = actual.contiguous().reshape(-1).view(at::kByte);
  const auto e = expected.contiguous().reshape(-1).view(at::kByte);
  TEST_CHECK_MSG(at::equal(a, e), what << ": the bytes differ");
}

}  // namespace vllm_lite::test
