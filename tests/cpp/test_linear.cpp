// int8_linear through the dispatcher (vllm_lite/kernels.h) against a float64 reference on
// the dequantized weight, for the block kernel (few rows) and the dequantize path (many).
#include <vllm_lite/kernels.h>

#include "harness.h"
#include "reference.h"

namespace vt = vllm_lite::test;

namespace {

void check_int8_linear(int64_t m, int64_t k, int64_t n, bool bias, uint64_t seed) {
  auto gen = vt::make_gen(seed);
  const auto x = at::randn({m, k}, gen);
  const auto q = at::randint(-127, 128, {n, k}, gen, at::kChar);
  const auto scales = at::rand({n}, gen) * 0.02 + 1e-4;
  const auto b = bias ? std::optional<at::Tensor>(at::randn({n}, gen)) : std::nullopt;
  const auto y = vllm_lite::int8_linear(x, q, scales, b);
  TEST_CHECK_MSG(y.sizes() == at::IntArrayRef({m, n}), "int8_linear: shape " << y.sizes());
  auto ref = x.to(at::kDouble).matmul(
      (q.to(at::kDouble) * scales.to(at::kDouble).unsqueeze(1)).t());
  if (b) ref = ref + b->to(at::kDouble);
  const double tol = 2e-6 * ref.abs().max().item<double>() + 1e-7;
  const double err = (y.to(at::kDouble) - ref).abs().max().item<double>();
  TEST_CHECK_MSG(err <= tol, "int8_linear [" << m << ", " << k << "] x [" << n
                 << "]: max abs error " << err << " > " << tol);
}

}  // namespace

VLLM_TEST(int8_linear_cpu) {
  check_int8_linear(1, 64, 32, false, 41);
  check_int8_linear(5, 37, 19, true, 42);   // odd rows, a short pass and a short task
  check_int8_linear(40, 48, 70, true, 43);  // past the block kernel's rows: dequantize
  TEST_CHECK_THROWS_WITH(
      vllm_lite::int8_linear(at::zeros({2, 8}), at::zeros({4, 9}, at::kChar), at::ones({4}),
                             std::nullopt),
      "int8_linear: x's last dimension (8) must equal qweight's K (9)");
}
