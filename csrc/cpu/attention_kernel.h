// CPU paged-attention kernel body, compiled once per instruction set: each
// attention_<isa>.cpp sets its target and VLLM_LITE_ISA_FN, then includes this file. Plain
// loops over fixed-width lane arrays let the compiler vectorize for that target (SSE2/NEON
// for generic, AVX2+FMA, AVX-512) with no intrinsics, so every build stays portable.
//
// Layouts (vLLM v0.6): key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x]
// with x = 16 bytes / element; value_cache [num_blocks, num_kv_heads, head_size,
// block_size]; query [num_seqs, num_heads, head_size] (strided rows allowed).
//
// Grid: one task per (sequence, KV head, partition of partition_size tokens); the caller
// runs tasks in parallel. A task serves all num_heads / num_kv_heads query heads of its KV
// head, so each K/V block of the partition is read from memory once (GQA/MQA):
//   1. K pass: per token, convert its key to float32 (L1 buffer), one dot product per
//      query head -> logits [group, partition_size] in scratch.
//   2. softmax statistics per head: max, exp (a branchless polynomial that vectorizes),
//      sum; logits become probabilities.
//   3. V pass: value rows are token-contiguous, so accumulate p * v with tokens across
//      kLanes lanes per (head, dim) and reduce lanes once at the end: no horizontal sum in
//      the inner loop. Heads are processed in chunks whose accumulators fit in L1/L2.
// Output per (seq, head, partition): max logit, exp sum, normalized output (float32), which
// attention.cpp combines across partitions. Limits: head_size a multiple of 8 up to 256,
// any block size, up to 64 query heads per KV head.
#include <cstdint>
#include <cstring>

#include "cpu/attention_params.h"

#ifndef VLLM_LITE_ISA_FN
#error "define VLLM_LITE_ISA_FN before including attention_kernel.h"
#endif

namespace vllm_lite::cpu {
// Internal linkage: this ISA's copies of these functions never merge with another build's.
namespace {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// IEEE half -> float without branches (so loops over it vectorize), exact for all inputs.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = (em << 13) + ((127u - 15u) << 23);
  bits = em >= 0x7c00u ? bits + ((128u - 16u) << 23) : bits;  // inf / nan
  const uint32_t sub = float_to_bits(static_cast<float>(em) * 5.9604644775390625e-08f);
  bits = em < 0x400u ? sub : bits;  // zero / subnormal: em * 2^-24
  return bits_to_float(bits | sign);
}

template <KvDType DT>
struct Elem;
template <>
struct Elem<KvDType::kFloat32> {
  using T = float;
  static float to_float(float v) { return v; }
};
template <>
struct Elem<KvDType::kFloat16> {
  using T = uint16_t;
  static float to_float(uint16_t v) { return half_to_float(v); }
};
template <>
struct Elem<KvDType::kBFloat16> {
  using T = uint16_t;
  static float to_float(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }
};

// exp(x) for x <= 0 (logits minus their max): 2^n * poly(r), |r| <= ln2/2, relative error
// ~2e-7. Branchless so the softmax loop vectorizes; below -87 it flushes towards zero.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693145751953125f;              // Cody-Waite: ln2 = hi + lo
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * bits_to_float(static_cast<uint32_t>(e) << 23);
}

// Dot product of two float arrays of n elements, n a multiple of kValueLanes.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kValueLanes] = {};
  for (int64_t i = 0; i < n; i += kValueLanes) {
    for (int64_t l = 0; l < kValueLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int64_t w = kValueLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

template <int64_t L>
inline float lane_sum(const float* a) {
  float acc[L];
  for (int64_t l = 0; l < L; ++l) acc[l] = a[l];
  for (int64_t w = L / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// L: token lanes of the V pass; 16 when the block size is a multiple of 16, else 8.
template <KvDType DT, int64_t L>
void attention_task(const AttentionParams& p, int64_t task, float* scratch) {
  using E = Elem<DT>;
  using T = typename E::T;
  constexpr int64_t X = 16 / sizeof(T);

  const int64_t part = task % p.num_partitions;
  const int64_t kh = (task / p.num_partitions) % p.num_kv_heads;
  const int64_t s = task / (p.num_partitions * p.num_kv_heads);
  const int64_t len = p.seq_lens[s];
  const int64_t P = p.partition_size;
  const int64_t start = part * P;
  if (start >= len) return;
  const int64_t end = len < start + P ? len : start + P;
  const int64_t n = end - start;

  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t h0 = kh * G;
  const int64_t D = p.head_size;
  const int64_t Dp = padded_head_size(D);
  const int64_t bs = p.block_size;
  const int64_t gc_max = value_head_chunk(G, D);

  // Scratch layout (attention_scratch_floats): q [G, Dp] | kbuf [Dp] | logits [G, P] |
  // vacc [gc_max, D, L] | pv [gc_max, L].
  float* q = scratch;
  float* kbuf = q + G * Dp;
  float* logits = kbuf + Dp;
  float* vacc = logits + G * P;
  float* pv = vacc + gc_max * D * kValueLanes;

  const T* qs = static_cast<const T*>(p.query) + s * p.q_stride_seq;
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = qs + (h0 + g) * p.q_stride_head;
    for (int64_t d = 0; d < D; ++d) q[g * Dp + d] = E::to_float(qg[d]) * p.scale;
    for (int64_t d = D; d < Dp; ++d) q[g * Dp + d] = 0.0f;
  }
  for (int64_t d = D; d < Dp; ++d) kbuf[d] = 0.0f;

  const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
  const int64_t head_stride = D * bs;                     // elements of one (block, kv head)
  const int64_t block_stride = p.num_kv_heads * head_stride;
  const T* kc = static_cast<const T*>(p.key_cache) + kh * head_stride;
  const T* vc = static_cast<const T*>(p.value_cache) + kh * head_stride;

  // 1. K pass.
  for (int64_t t = start; t < end;) {
    const int64_t block = table[t / bs];
    const int64_t off = t % bs;
    const int64_t cnt = bs - off < end - t ? bs - off : end - t;
    const T* kblk = kc + block * block_stride;
    for (int64_t i = 0; i < cnt; ++i) {
      const T* kt = kblk + (off + i) * X;
      for (int64_t c = 0; c < D / X; ++c) {
        for (int64_t j = 0; j < X; ++j) kbuf[c * X + j] = E::to_float(kt[c * bs * X + j]);
      }
      for (int64_t g = 0; g < G; ++g) logits[g * P + (t - start) + i] = dot(q + g * Dp, kbuf, Dp);
    }
    t += cnt;
  }

  // 2. Softmax statistics.
  float sums[64];
  for (int64_t g = 0; g < G; ++g) {
    float* lg = logits + g * P;
    if (p.alibi_slopes != nullptr) {
      const float slope = p.alibi_slopes[h0 + g];
      for (int64_t i = 0; i < n; ++i) lg[i] += slope * static_cast<float>(start + i - len + 1);
    }
    float m = lg[0];
    for (int64_t i = 1; i < n; ++i) m = lg[i] > m ? lg[i] : m;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      lg[i] = exp_nonpositive(lg[i] - m);
      sum += lg[i];
    }
    sums[g] = sum;
    const int64_t idx = (s * p.num_heads + h0 + g) * p.num_partitions + part;
    p.part_max[idx] = m;
    p.part_sum[idx] = sum;
  }

  // 3. V pass, gc_max heads at a time.
  for (int64_t g0 = 0; g0 < G; g0 += gc_max) {
    const int64_t gc = G - g0 < gc_max ? G - g0 : gc_max;
    std::memset(vacc, 0, sizeof(float) * gc * D * L);
    for (int64_t t = start; t < end;) {
      const int64_t block = table[t / bs];
      const int64_t off = t % bs;
      const int64_t cnt = bs - off < end - t ? bs - off : end - t;
      const T* vblk = vc + block * block_stride + off;
      for (int64_t i0 = 0; i0 < cnt; i0 += L) {
        const int64_t m = cnt - i0 < L ? cnt - i0 : L;
        for (int64_t g = 0; g < gc; ++g) {
          const float* lg = logits + (g0 + g) * P + (t - start) + i0;
          // The clamped index keeps the load in bounds, so the loop vectorizes unmasked.
          for (int64_t l = 0; l < L; ++l) pv[g * L + l] = l < m ? lg[l < m ? l : 0] : 0.0f;
        }
        for (int64_t d = 0; d < D; ++d) {
          const T* vr = vblk + d * bs + i0;
          float vf[L];
          if (m == L) {
            for (int64_t l = 0; l < L; ++l) vf[l] = E::to_float(vr[l]);
          } else {  // never read past the partition's last token: it may end the pool
            for (int64_t l = 0; l < m; ++l) vf[l] = E::to_float(vr[l]);
            for (int64_t l = m; l < L; ++l) vf[l] = 0.0f;
          }
          for (int64_t g = 0; g < gc; ++g) {
            float* a = vacc + (g * D + d) * L;
            const float* pg = pv + g * L;
            for (int64_t l = 0; l < L; ++l) a[l] += pg[l] * vf[l];
          }
        }
      }
      t += cnt;
    }
    for (int64_t g = 0; g < gc; ++g) {
      const float inv = p.v_scale / sums[g0 + g];
      float* out = p.part_out + ((s * p.num_heads + h0 + g0 + g) * p.num_partitions + part) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = lane_sum<L>(vacc + (g * D + d) * L) * inv;
    }
  }
}

void run_task(const AttentionParams& p, int64_t task, float* scratch) {
  const bool wide = p.block_size % 16 == 0;
  switch (p.dtype) {
    case KvDType::kFloat32:
      return wide ? attention_task<KvDType::kFloat32, 16>(p, task, scratch)
                  : attention_task<KvDType::kFloat32, 8>(p, task, scratch);
    case KvDType::kFloat16:
      return wide ? attention_task<KvDType::kFloat16, 16>(p, task, scratch)
                  : attention_task<KvDType::kFloat16, 8>(p, task, scratch);
    case KvDType::kBFloat16:
      return wide ? attention_task<KvDType::kBFloat16, 16>(p, task, scratch)
                  : attention_task<KvDType::kBFloat16, 8>(p, task, scratch);
  }
}

}  // namespace

AttentionTaskFn VLLM_LITE_ISA_FN() { return &run_task; }

}  // namespace vllm_lite::cpu
