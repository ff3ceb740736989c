// fused_moe on the CPU: a mixture-of-experts block (layers/moe.py states the contract).
//   1. routing, per token (parallel over tokens): softmax of the E logits in float32, the
//      top_k largest (ties to the lower expert id), divided by their sum if renormalize;
//   2. a counting sort of the T * top_k (token, slot) pairs by expert, stable (token order
//      within an expert), and each pair's row of hidden gathered into that order;
//   3. per expert that got rows: one GEMM of its rows by its gate_up weight with
//      SiLU-and-mul, one GEMM by its down weight, each rounded to the dtype (the unfused
//      projections' rounding);
//   4. per token (parallel over tokens): the sum of its top_k rows times their routing
//      weights in float32, rounded once to the dtype.
// The GEMMs of step 3 are packed_linear's kernels (packed_linear_params.h; the AVX-512 /
// AVX512-BF16 / AMX builds that cpu_isa selects) on weights packed per expert by
// ops.pack_moe_weights: the gate_up GEMM is packed_gated_linear's, with the activation in
// its epilogue. Expert rows and panel ranges are split into items that torch's intra-op
// threads share, so one decode token's two experts run on different threads. Where the
// selected build has no packed kernel for the dtype (AVX2 and generic builds, float16),
// or the weights are not packed, each expert's GEMMs go through at::mm on its
// [E, 2I, H] / [E, H, I] slices, and silu_and_mul (packed_gated_linear / packed_linear and
// their own fallbacks for packed weights): the experts then run one per thread where
// there are at least as many as threads, else one after another on all threads. On plain
// float32 / bfloat16 weights with AVX2, moe_rows_gemm.h's kernel takes float32 experts of
// at most kMoeRowsGemmMaxRowsF32 rows (a decode step's) and bfloat16 experts of any size,
// in (expert, weight rows) items that the threads share: at::mm's per-call cost and
// one-expert-per-thread split were most of a decode step's MoE time there, and its
// bfloat16 GEMM is slow at every size without AVX512-BF16.
// An expert no token chose is never read.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/moe_rows_gemm.h"
#include "cpu/packed_linear_params.h"
#include "moe_limits.h"
#include "ops.h"
#include "validate.h"

namespace vllm_lite::cpu {
namespace {

// The selected build's packed kernel for dtype, as packed_linear picks it.
PackedLinearFn moe_kernel(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) {
    if (cpu_isa_includes("amxbf16")) return packed_linear_bf16_amx();
    return cpu_isa_includes("avx512bf16") ? packed_linear_bf16_avx512bf16() : nullptr;
  }
  if (dtype == at::kFloat) return cpu_isa_includes("avx512") ? packed_linear_f32_avx512() : nullptr;
  return nullptr;
}

// One token's routing: weights[j], ids[j] for j < k from its logits (float32 softmax).
// A NaN logit makes every probability NaN, as torch.softmax does; the ids stay distinct
// and in range whatever the values (a NaN never wins a comparison, so the lowest unchosen
// id takes its slot).
template <typename L>
void route_token(const L* logits, int64_t E, int64_t k, bool renormalize, float* probs,
                 float* weights, int32_t* ids) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<float>(logits[e]));
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) {
    probs[e] = std::exp(static_cast<float>(logits[e]) - m);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  uint64_t chosen[kMoeMaxNumExperts / 64] = {};
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (chosen[e / 64] >> (e % 64) & 1u) continue;
      if (best < 0 || probs[e] > probs[best]) best = e;
    }
    chosen[best / 64] |= uint64_t{1} << (best % 64);
    weights[j] = probs[best];
    ids[j] = static_cast<int32_t>(best);
    total += probs[best];
  }
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
  }
}

// An expert's rows in the sorted order: [start, start + rows).
struct ExpertRows {
  int64_t expert, start, rows;
};

// Runs fn(i) for i in [0, n) on torch's intra-op threads, each thread taking the next
// index when it is free (the items differ in size: experts' row counts).
template <typename Fn>
void run_items(int64_t n, Fn&& fn) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

// Step 3 on packed weights with the selected kernel: items of (expert, panel range), the
// gate_up GEMMs first (into act [P, I]), then the down GEMMs (into ys [P, H]).
void packed_experts(PackedLinearFn fn, const MoeDims& d, const std::vector<ExpertRows>& active,
                    const at::Tensor& xs, const at::Tensor& w13, const at::Tensor& w2,
                    at::Tensor& act, at::Tensor& ys) {
  const int64_t H = d.hidden, I = d.intermediate, P = xs.size(0);
  const int64_t esz = xs.element_size();
  const int64_t threads = at::get_num_threads();
  const auto* x = static_cast<const char*>(xs.data_ptr());
  auto* a = static_cast<char*>(act.data_ptr());
  auto* y = static_cast<char*>(ys.data_ptr());
  const auto* w13p = static_cast<const char*>(w13.data_ptr());
  const auto* w2p = static_cast<const char*>(w2.data_ptr());
  const int64_t w13_bytes = w13.numel() / d.experts * esz, w2_bytes = w2.numel() / d.experts * esz;
  struct Item {
    int64_t active, p0, p1;
  };
  // An expert's panels split in proportion to its share of the rows, about four items per
  // thread in all (an item walks whole panels, so a thread prefetches its next one).
  const auto items_of = [&](int64_t panels) {
    std::vector<Item> items;
    for (int64_t i = 0; i < static_cast<int64_t>(active.size()); ++i) {
      const int64_t parts =
          std::clamp<int64_t>((4 * threads * active[i].rows + P - 1) / P, 1, panels);
      for (int64_t c = 0; c < parts; ++c) {
        items.push_back({i, c * panels / parts, (c + 1) * panels / parts});
      }
    }
    return items;
  };
  const int64_t panels13 = w13.size(1), panels2 = w2.size(1);
  const std::vector<Item> up = items_of(panels13);
  run_items(static_cast<int64_t>(up.size()), [&](int64_t i) {
    const ExpertRows& r = active[up[i].active];
    PackedLinearArgs args{x + r.start * H * esz, w13p + r.expert * w13_bytes, nullptr,
                          a + r.start * I * esz, r.rows, H, I, H};
    args.gated = true;
    fn(args, up[i].p0, up[i].p1);
  });
  const std::vector<Item> down = items_of(panels2);
  run_items(static_cast<int64_t>(down.size()), [&](int64_t i) {
    const ExpertRows& r = active[down[i].active];
    const PackedLinearArgs args{a + r.start * I * esz, w2p + r.expert * w2_bytes, nullptr,
                                y + r.start * H * esz, r.rows, I, H, I};
    fn(args, down[i].p0, down[i].p1);
  });
}

// Step 3 through ATen (no packed kernel for this build and dtype, or plain weights).
void aten_experts(const MoeDims& d, const std::vector<ExpertRows>& active, const at::Tensor& xs,
                  const at::Tensor& w13, const at::Tensor& w2, at::Tensor& act, at::Tensor& ys) {
  const auto one = [&](int64_t i) {
    // Per thread (the guard is thread-local, and torch's OpenMP pool does not carry it):
    // the op has no autograd formula, and at::mm_out on weights that are parameters must
    // not try to record one.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const ExpertRows& r = active[i];
    const at::Tensor x = xs.narrow(0, r.start, r.rows);
    at::Tensor a = act.narrow(0, r.start, r.rows);
    at::Tensor y = ys.narrow(0, r.start, r.rows);
    if (d.packed) {
      a.copy_(packed_gated_linear(x, w13[r.expert], std::nullopt, d.intermediate));
      y.copy_(packed_linear(a, w2[r.expert], std::nullopt, d.hidden));
      return;
    }
    const at::Tensor gate_up = at::mm(x, w13[r.expert].t());
    silu_and_mul(a, gate_up);
    at::mm_out(y, a, w2[r.expert].t());
  };
  const int64_t n = static_cast<int64_t>(active.size());
  if (n >= at::get_num_threads()) {
    run_items(n, one);
  } else {
    for (int64_t i = 0; i < n; ++i) one(i);
  }
}

// The few-rows GEMM for plain weights of dtype where this build has no packed kernel
// (nullptr elsewhere: no such kernel for the dtype or the build).
MoeRowsGemmFn rows_kernel(at::ScalarType dtype) {
  if (!cpu_isa_includes("avx2")) return nullptr;
  if (dtype == at::kFloat) return moe_rows_gemm_f32_avx2();
  return dtype == at::kBFloat16 ? moe_rows_gemm_bf16_avx2() : nullptr;
}

// Step 3 on plain weights for the experts moe_rows_gemm.h's kernel takes (a decode
// step's; every bfloat16 one): items of (expert, range of weight rows) that the threads share, so every
// expert's weights stream once with both cores on them; first the gate_up GEMMs (into a
// [P, 2I] buffer, rounded to T), silu_and_mul per expert, then the down GEMMs. The kernel
// takes float32 rows of x: bfloat16 rows are widened first (exact).
template <typename T>
void rows_experts(MoeRowsGemmFn fn, const MoeDims& d, const std::vector<ExpertRows>& small,
                  const at::Tensor& xs, const at::Tensor& w13, const at::Tensor& w2,
                  at::Tensor& act, at::Tensor& ys) {
  const int64_t H = d.hidden, I = d.intermediate, P = xs.size(0);
  const auto widen = [&](const at::Tensor& src, int64_t K) {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      at::Tensor dst = at::empty({P, K}, src.options().dtype(at::kFloat));
      const T* s = src.data_ptr<T>();
      float* o = dst.data_ptr<float>();
      for (const ExpertRows& r : small) {
        for (int64_t i = r.start * K; i < (r.start + r.rows) * K; ++i) o[i] = static_cast<float>(s[i]);
      }
      return dst;
    }
  };
  struct Item {
    int64_t expert, n0, n1;
  };
  // About 64 KiB of weights per item: enough items for the threads to even out, few
  // enough that taking one costs nothing.
  const auto items_of = [&](int64_t N, int64_t K) {
    const int64_t chunk =
        std::max<int64_t>(4, (int64_t{64} * 1024 / (K * xs.element_size())) / 4 * 4);
    std::vector<Item> items;
    for (int64_t i = 0; i < static_cast<int64_t>(small.size()); ++i) {
      for (int64_t n0 = 0; n0 < N; n0 += chunk) items.push_back({i, n0, std::min(N, n0 + chunk)});
    }
    return items;
  };
  const at::Tensor xf = widen(xs, H);
  at::Tensor gate_up = at::empty({P, 2 * I}, xs.options());
  const float* x = xf.data_ptr<float>();
  T* gu = gate_up.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  const std::vector<Item> up = items_of(2 * I, H);
  run_items(static_cast<int64_t>(up.size()), [&](int64_t i) {
    const ExpertRows& r = small[up[i].expert];
    fn(x + r.start * H, r.rows, H, w13p + r.expert * 2 * I * H, gu + r.start * 2 * I + up[i].n0,
       2 * I, up[i].n0, up[i].n1);
  });
  for (const ExpertRows& r : small) {
    at::Tensor a = act.narrow(0, r.start, r.rows);
    silu_and_mul(a, gate_up.narrow(0, r.start, r.rows));
  }
  const at::Tensor af = widen(act, I);
  const float* a = af.data_ptr<float>();
  T* y = ys.data_ptr<T>();
  const std::vector<Item> down = items_of(H, I);
  run_items(static_cast<int64_t>(down.size()), [&](int64_t i) {
    const ExpertRows& r = small[down[i].expert];
    fn(a + r.start * I, r.rows, I, w2p + r.expert * H * I, y + r.start * H + down[i].n0, H,
       down[i].n0, down[i].n1);
  });
}

template <typename T, typename L>
void fused_moe_impl(const MoeDims& d, const at::Tensor& hidden, const at::Tensor& router_logits,
                    const at::Tensor& w13, const at::Tensor& w2, bool renormalize,
                    at::Tensor& out) {
  const int64_t Tn = d.tokens, H = d.hidden, E = d.experts, k = d.top_k, P = Tn * k;
  // 1. routing
  std::vector<float> weights(P);
  std::vector<int32_t> ids(P);
  const L* logits = router_logits.data_ptr<L>();
  at::parallel_for(0, Tn, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> probs(E);
    for (int64_t t = t0; t < t1; ++t) {
      route_token(logits + t * E, E, k, renormalize, probs.data(), weights.data() + t * k,
                  ids.data() + t * k);
    }
  });
  // 2. counting sort by expert; row_of[p]: pair p's row in the sorted order
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), row_of(P), token_of_row(P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t r = fill[ids[p]]++;
    row_of[p] = r;
    token_of_row[r] = p / k;
  }
  std::vector<ExpertRows> active;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > start[e]) active.push_back({e, start[e], start[e + 1] - start[e]});
  }
  // The largest experts first, so the threads that take them are not the last to finish.
  std::stable_sort(active.begin(), active.end(),
                   [](const ExpertRows& a, const ExpertRows& b) { return a.rows > b.rows; });
  at::Tensor xs = at::empty({P, H}, hidden.options());
  const T* x = hidden.data_ptr<T>();
  T* xr = xs.data_ptr<T>();
  at::parallel_for(0, P, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(xr + r * H, x + token_of_row[r] * H, H * sizeof(T));
    }
  });
  // 3. the experts
  at::Tensor act = at::empty({P, d.intermediate}, hidden.options());
  at::Tensor ys = at::empty({P, H}, hidden.options());
  const PackedLinearFn fn = d.packed ? moe_kernel(hidden.scalar_type()) : nullptr;
  const MoeRowsGemmFn rows_fn = d.packed ? nullptr : rows_kernel(hidden.scalar_type());
  if (fn != nullptr) {
    packed_experts(fn, d, active, xs, w13, w2, act, ys);
  } else if (rows_fn != nullptr) {
    // active is sorted by rows, most first: the experts past `split` take the few-rows GEMM.
    const int64_t max_rows = std::is_same_v<T, float> ? kMoeRowsGemmMaxRowsF32 : P;
    const auto split = std::find_if(active.begin(), active.end(), [&](const ExpertRows& r) {
      return r.rows <= max_rows;
    });
    const std::vector<ExpertRows> large(active.begin(), split), small(split, active.end());
    aten_experts(d, large, xs, w13, w2, act, ys);
    if (!small.empty()) {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        rows_experts<T>(rows_fn, d, small, xs, w13, w2, act, ys);
      }
    }
  } else {
    aten_experts(d, active, xs, w13, w2, act, ys);
  }
  // 4. weighted sum in token order
  const T* y = ys.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, Tn, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const T* row = y + row_of[t * k + j] * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(row[h]);
      }
      for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<T>(acc[h]);
    }
  });
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,
                     const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,
                     bool renormalize) {
  const MoeDims d = check_fused_moe(hidden, router_logits, w13, w2, top_k, kPackedPanelCols);
  TORCH_CHECK(hidden.device().is_cpu(),
              "fused_moe: the CPU kernel needs CPU tensors, got hidden on ", hidden.device());
  at::Tensor out = at::empty({d.tokens, d.hidden}, hidden.options());
  if (d.tokens == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "fused_moe", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, router_logits.scalar_type(),
                                    "fused_moe_logits", [&] {
      fused_moe_impl<T, scalar_t>(d, hidden, router_logits, w13, w2, renormalize, out);
    });
  });
  return out;
}

}  // namespace vllm_lite::cpu
