// CPU element-wise kernels of a decoder layer (rms_norm / fused_add_rms_norm, silu_and_mul,
// rotary_embedding) and of the sampler's greedy rows (greedy_sample), built once per
// instruction set like attention_kernel.h: each elementwise_<isa>.cpp sets its target,
// VLLM_LITE_ELEMENTWISE_FN (the name of the function returning this build's kernels) and
// VLLM_LITE_VEC_WIDTH (floats per native vector: 4, 8 or 16), then includes this file.
//
// Semantics (ops.h): math in float32 with Hugging Face Llama's rounding steps, round_T =
// round to the tensor dtype, nearest even (bit-exact with torch's casts, NaN kept NaN), so
// bf16 / fp16 models round where HF's eager code does.
//
// Layouts: rows of `hidden` (rms_norm), 2 * d (silu_and_mul) or vocab (greedy_sample)
// elements, input rows at any stride, outputs contiguous; rotary: per token, heads of
// head_size contiguous, tokens at q_stride / k_stride, table rows [cos | sin] of rot_dim.
// Every row is W-wide vectors plus one zero-padded partial vector, so any width works; the
// caller splits rows over threads.
// Limits: none beyond memory (rotary keeps a token's rounded cos/sin, rot_dim floats, on
// the heap once per call).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/elementwise_params.h"
#include "cpu/vec.h"

#ifndef VLLM_LITE_ELEMENTWISE_FN
#error "define VLLM_LITE_ELEMENTWISE_FN before including elementwise_kernel.h"
#endif

namespace vllm_lite::cpu {
namespace {

constexpr int64_t EW = VLLM_LITE_VEC_WIDTH;
using EF = Vec<float, EW>;
using EU = Vec<uint32_t, EW>;
using EI = Vec<int32_t, EW>;

// Element storage per dtype: load W elements as floats, store W floats rounded to it.
template <KvDType DT>
struct Lanes;

// round_T of float32 is the identity, but where the contract rounds, the value must exist:
// an empty asm that "changes" it keeps the compiler from fusing the product before it into
// a multiply-add with what follows (HF's eager code rounds each product; a fused rotary
// would differ in the last bit). Other multiply-adds (the exp polynomial) stay fused.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VLLM_LITE_MATERIALIZE(v) asm("" : "+x"(v))
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define VLLM_LITE_MATERIALIZE(v) asm("" : "+w"(v))
#else
#define VLLM_LITE_MATERIALIZE(v) (void)(v)
#endif

template <>
struct Lanes<KvDType::kFloat32> {
  using T = float;
  VLLM_LITE_INLINE static EF load(const T* p) { return load_vec<EF>(p); }
  VLLM_LITE_INLINE static void store(T* p, EF v) { store_vec(p, v); }
  VLLM_LITE_INLINE static EF round(EF v) {
    VLLM_LITE_MATERIALIZE(v);
    return v;
  }
};

template <>
struct Lanes<KvDType::kBFloat16> {
  using T = uint16_t;
  VLLM_LITE_INLINE static EF load(const T* p) {
    return (EF)(__builtin_convertvector(load_vec<Vec<uint16_t, EW>>(p), EU) << 16);
  }
  VLLM_LITE_INLINE static EU bits(EF v) { return bf16_bits<EU>(v); }
  VLLM_LITE_INLINE static void store(T* p, EF v) {
    store_vec(p, __builtin_convertvector(bits(v), Vec<uint16_t, EW>));
  }
  VLLM_LITE_INLINE static EF round(EF v) { return (EF)(bits(v) << 16); }
};

template <>
struct Lanes<KvDType::kFloat16> {
  using T = uint16_t;
  VLLM_LITE_INLINE static EF load(const T* p) {
    return half_lanes_to_float<EW>(__builtin_convertvector(load_vec<Vec<uint16_t, EW>>(p), EU));
  }
  // float -> IEEE half bits, nearest even, branchless: normal results round the mantissa
  // at bit 13 (a carry moves into the exponent as it should); below 2^-14 adding 0.5f
  // rounds |v| to a multiple of 2^-24 (0.5f's ulp), the subnormal half's step; from
  // 65520 (halfway past the largest half) up it is inf; NaN stays a quiet NaN.
  VLLM_LITE_INLINE static EU bits(EF v) {
    const EU b = (EU)v;
    const EU a = b & 0x7fffffffu;
    const EU sign = (b >> 16) & 0x8000u;
    const EU normal = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    const EU sub = (EU)((EF)a + 0.5f) - 0x3f000000u;
    EU h = a < 0x38800000u ? sub : normal;
    h = a >= 0x477ff000u ? EU{} + 0x7c00u : h;
    h = a > 0x7f800000u ? EU{} + 0x7e00u : h;
    return h | sign;
  }
  VLLM_LITE_INLINE static void store(T* p, EF v) {
    store_vec(p, __builtin_convertvector(bits(v), Vec<uint16_t, EW>));
  }
  VLLM_LITE_INLINE static EF round(EF v) { return half_lanes_to_float<EW>(bits(v)); }
};

// The last n < W elements of a row through a zero-padded vector.
template <KvDType DT>
VLLM_LITE_INLINE EF load_part(const typename Lanes<DT>::T* p, int64_t n) {
  typename Lanes<DT>::T buf[EW] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(buf[0]));
  return Lanes<DT>::load(buf);
}
template <KvDType DT>
VLLM_LITE_INLINE void store_part(typename Lanes<DT>::T* p, EF v, int64_t n) {
  typename Lanes<DT>::T buf[EW];
  Lanes<DT>::store(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(buf[0]));
}

VLLM_LITE_INLINE float lane_sum(EF v) {
  float s = 0.f;
  for (int64_t l = 0; l < EW; ++l) s += v[l];
  return s;
}

template <KvDType DT>
void rms_norm_rows(const RmsNormArgs& a, int64_t r0, int64_t r1) {
  using L = Lanes<DT>;
  using T = typename L::T;
  const int64_t H = a.hidden;
  const int64_t full = H - H % EW;
  const T* w = static_cast<const T*>(a.weight);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(a.input) + r * a.input_row_stride;
    T* out = static_cast<T*>(a.out) + r * H;
    // The normalized values: the input, or with a residual the rounded sum (written to
    // the residual, and read back from there by the second pass).
    const T* src = x;
    EF acc{};
    if (a.residual != nullptr) {
      T* res = static_cast<T*>(a.residual) + r * H;
      for (int64_t i = 0; i < full; i += EW) {
        const EF s = L::round(L::load(x + i) + L::load(res + i));
        L::store(res + i, s);
        acc += s * s;
      }
      if (full < H) {
        const EF s = L::round(load_part<DT>(x + full, H - full) + load_part<DT>(res + full, H - full));
        store_part<DT>(res + full, s, H - full);
        acc += s * s;  // padding lanes are 0 + 0
      }
      src = res;
    } else {
      for (int64_t i = 0; i < full; i += EW) {
        const EF v = L::load(x + i);
        acc += v * v;
      }
      if (full < H) {
        const EF v = load_part<DT>(x + full, H - full);
        acc += v * v;
      }
    }
    // HF: variance = mean(x^2) in float32, then rsqrt(variance + eps).
    const float inv = 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(H) + a.epsilon);
    for (int64_t i = 0; i < full; i += EW) {
      L::store(out + i, L::load(w + i) * L::round(L::load(src + i) * inv));
    }
    if (full < H) {
      const int64_t n = H - full;
      store_part<DT>(out + full, load_part<DT>(w + full, n) * L::round(load_part<DT>(src + full, n) * inv), n);
    }
  }
}

template <KvDType DT>
void silu_and_mul_rows(const SiluAndMulArgs& a, int64_t r0, int64_t r1) {
  using L = Lanes<DT>;
  using T = typename L::T;
  const int64_t D = a.d;
  const int64_t full = D - D % EW;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(a.input) + r * a.input_row_stride;
    const T* u = g + D;
    T* out = static_cast<T*>(a.out) + r * D;
    int64_t i = 0;
    // Two vectors per step: the exp polynomial and the division are one long dependency
    // chain per vector, so a second independent one keeps the FP units busy.
    for (; i + 2 * EW <= full; i += 2 * EW) {
      const EF a = silu<EF, EI>(L::load(g + i));
      const EF b = silu<EF, EI>(L::load(g + i + EW));
      L::store(out + i, L::round(a) * L::load(u + i));
      L::store(out + i + EW, L::round(b) * L::load(u + i + EW));
    }
    for (; i < full; i += EW) {
      L::store(out + i, L::round(silu<EF, EI>(L::load(g + i))) * L::load(u + i));
    }
    if (full < D) {
      const int64_t n = D - full;
      store_part<DT>(out + full, L::round(silu<EF, EI>(load_part<DT>(g + full, n))) * load_part<DT>(u + full, n), n);
    }
  }
}

// Rotates one head in place with the token's rounded cos / sin (half = rot_dim / 2 each).
template <KvDType DT>
VLLM_LITE_INLINE void rotate_head(typename Lanes<DT>::T* x, const float* c, const float* s,
                                  int64_t half, bool is_neox) {
  using L = Lanes<DT>;
  using T = typename L::T;
  if (is_neox) {
    T* x2 = x + half;
    const int64_t full = half - half % EW;
    for (int64_t i = 0; i <= full; i += EW) {
      const int64_t n = i < full ? EW : half - full;
      if (n == 0) break;
      const EF a = n == EW ? L::load(x + i) : load_part<DT>(x + i, n);
      const EF b = n == EW ? L::load(x2 + i) : load_part<DT>(x2 + i, n);
      EF cv, sv;
      if (n == EW) {
        cv = load_vec<EF>(c + i);
        sv = load_vec<EF>(s + i);
      } else {
        cv = EF{};
        sv = EF{};
        for (int64_t l = 0; l < n; ++l) cv[l] = c[i + l], sv[l] = s[i + l];
      }
      const EF na = L::round(L::round(a * cv) - L::round(b * sv));
      const EF nb = L::round(L::round(b * cv) + L::round(a * sv));
      if (n == EW) {
        L::store(x + i, na);
        L::store(x2 + i, nb);
      } else {
        store_part<DT>(x + i, na, n);
        store_part<DT>(x2 + i, nb, n);
      }
    }
    return;
  }
  // GPT-J pairs (2i, 2i + 1): interleaved, so go through vectors of W pairs' halves.
  for (int64_t i0 = 0; i0 < half; i0 += EW) {
    const int64_t n = half - i0 < EW ? half - i0 : EW;
    T ab[2 * EW] = {};
    std::memcpy(ab, x + 2 * i0, static_cast<size_t>(2 * n) * sizeof(T));
    T ea[EW] = {}, eb[EW] = {};
    for (int64_t l = 0; l < n; ++l) ea[l] = ab[2 * l], eb[l] = ab[2 * l + 1];
    const EF a = L::load(ea), b = L::load(eb);
    EF cv{}, sv{};
    for (int64_t l = 0; l < n; ++l) cv[l] = c[i0 + l], sv[l] = s[i0 + l];
    L::store(ea, L::round(L::round(a * cv) - L::round(b * sv)));
    L::store(eb, L::round(L::round(b * cv) + L::round(a * sv)));
    for (int64_t l = 0; l < n; ++l) ab[2 * l] = ea[l], ab[2 * l + 1] = eb[l];
    std::memcpy(x + 2 * i0, ab, static_cast<size_t>(2 * n) * sizeof(T));
  }
}

template <KvDType DT>
void rotary_rows(const RotaryArgs& a, int64_t t0, int64_t t1) {
  using L = Lanes<DT>;
  using T = typename L::T;
  const int64_t half = a.rot_dim / 2;
  // cos / sin of the token's position, rounded to the dtype as HF casts its table; padded
  // to whole vectors.
  const int64_t padded = (half + EW - 1) / EW * EW;
  std::vector<float> cs(static_cast<size_t>(2 * padded), 0.f);
  float* c = cs.data();
  float* s = c + padded;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t pos = a.positions[t];
    if (a.float_table) {
      const float* row = static_cast<const float*>(a.cos_sin_cache) + pos * a.rot_dim;
      for (int64_t i = 0; i < padded; i += EW) {
        const int64_t n = half - i < EW ? half - i : EW;
        EF cv{}, sv{};
        for (int64_t l = 0; l < n; ++l) cv[l] = row[i + l], sv[l] = row[half + i + l];
        store_vec(c + i, L::round(cv));
        store_vec(s + i, L::round(sv));
      }
    } else {
      const T* row = static_cast<const T*>(a.cos_sin_cache) + pos * a.rot_dim;
      for (int64_t i = 0; i < padded; i += EW) {
        const int64_t n = half - i < EW ? half - i : EW;
        store_vec(c + i, load_part<DT>(row + i, n));
        store_vec(s + i, load_part<DT>(row + half + i, n));
      }
    }
    T* q = static_cast<T*>(a.query) + t * a.q_stride;
    for (int64_t h = 0; h < a.num_heads; ++h) rotate_head<DT>(q + h * a.head_size, c, s, half, a.is_neox);
    T* k = static_cast<T*>(a.key) + t * a.k_stride;
    for (int64_t h = 0; h < a.num_kv_heads; ++h) rotate_head<DT>(k + h * a.head_size, c, s, half, a.is_neox);
  }
}

// Greedy sampling of rows of logits in two passes over each row: (1) per lane, the
// running maximum and the index where it first appeared (a strict > keeps the first),
// plus whether any lane saw a NaN; across lanes, the lowest index holding the maximum m
// (lanes hold disjoint indices, so that is the row's first maximum, torch.argmax's
// choice); (2) s = sum exp(x - m), two vectors per step for the exp chains. The chosen
// token's log_softmax is x - m - log(s) = -log(s). A row with a NaN or a maximum that is
// not finite gets -1 / NaN: torch's argmax and log_softmax define those rows, and the
// caller takes them (sampler.py).
template <KvDType DT>
void greedy_rows(const GreedySampleArgs& a, int64_t r0, int64_t r1) {
  using L = Lanes<DT>;
  using T = typename L::T;
  const int64_t V = a.vocab;
  const int64_t full = V - V % EW;
  EI lane;
  for (int64_t l = 0; l < EW; ++l) lane[l] = static_cast<int32_t>(l);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(a.logits) + r * a.row_stride;
    EF mv = EF{} - INFINITY;
    EI iv = EI{};
    EI nan = EI{};
    for (int64_t i = 0; i < full; i += EW) {
      const EF v = L::load(x + i);
      nan |= (EI)(v != v);
      const EI gt = (EI)(v > mv);
      mv = gt ? v : mv;
      iv = gt ? lane + static_cast<int32_t>(i) : iv;
    }
    float m = -INFINITY;
    int64_t token = -1;
    bool bad = false;
    for (int64_t l = 0; l < EW; ++l) {
      bad |= nan[l] != 0;
      if (mv[l] > m || (mv[l] == m && iv[l] < token)) m = mv[l], token = iv[l];
    }
    const int64_t n = V - full;
    EF tail{};
    if (n > 0) tail = load_part<DT>(x + full, n);
    for (int64_t l = 0; l < n; ++l) {  // later indices: only a larger value replaces m
      bad |= tail[l] != tail[l];
      if (tail[l] > m) m = tail[l], token = full + l;
    }
    if (bad || !std::isfinite(m)) {
      a.token_ids[r] = -1;
      a.logprobs[r] = NAN;
      continue;
    }
    const EF mm = EF{} + m;
    EF s0{}, s1{};
    int64_t i = 0;
    for (; i + 2 * EW <= full; i += 2 * EW) {
      s0 += exp_nonpositive<EF, EI>(L::load(x + i) - mm);
      s1 += exp_nonpositive<EF, EI>(L::load(x + i + EW) - mm);
    }
    for (; i < full; i += EW) s0 += exp_nonpositive<EF, EI>(L::load(x + i) - mm);
    s0 += s1;
    float s = 0.0f;
    for (int64_t l = 0; l < EW; ++l) s += s0[l];
    for (int64_t l = 0; l < n; ++l) s += std::exp(tail[l] - m);
    a.token_ids[r] = token;
    a.logprobs[r] = -std::log(s);
  }
}

template <template <KvDType> class Fn, typename Args>
void by_dtype(const Args& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case KvDType::kFloat32: Fn<KvDType::kFloat32>::run(a, r0, r1); return;
    case KvDType::kFloat16: Fn<KvDType::kFloat16>::run(a, r0, r1); return;
    default: Fn<KvDType::kBFloat16>::run(a, r0, r1); return;  // validated: no other dtype
  }
}
template <KvDType DT>
struct RmsNormOp {
  static void run(const RmsNormArgs& a, int64_t r0, int64_t r1) { rms_norm_rows<DT>(a, r0, r1); }
};
template <KvDType DT>
struct SiluAndMulOp {
  static void run(const SiluAndMulArgs& a, int64_t r0, int64_t r1) { silu_and_mul_rows<DT>(a, r0, r1); }
};
template <KvDType DT>
struct RotaryOp {
  static void run(const RotaryArgs& a, int64_t r0, int64_t r1) { rotary_rows<DT>(a, r0, r1); }
};
template <KvDType DT>
struct GreedySampleOp {
  static void run(const GreedySampleArgs& a, int64_t r0, int64_t r1) { greedy_rows<DT>(a, r0, r1); }
};

}  // namespace

ElementwiseFns VLLM_LITE_ELEMENTWISE_FN() {
  return {&by_dtype<RmsNormOp, RmsNormArgs>, &by_dtype<SiluAndMulOp, SiluAndMulArgs>,
          &by_dtype<RotaryOp, RotaryArgs>, &by_dtype<GreedySampleOp, GreedySampleArgs>};
}

}  // namespace vllm_lite::cpu
