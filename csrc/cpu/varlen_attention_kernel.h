// CPU varlen paged-attention (prefill) kernel body, compiled once per instruction set like
// attention_kernel.h, whose helpers it uses: each attention_<isa>.cpp includes that file,
// sets VLLM_LITE_VARLEN_ISA_FN, then includes this one.
//
// Layouts: query [num_tokens, num_heads, head_size] flat over sequences (sequence i's rows
// are query_start_loc[i] .. query_start_loc[i + 1]); the caches in the split or flash
// layout of attention_kernel.h (the new tokens' K/V already written). Query token j of a sequence
// with n new tokens and context length L sits at position L - n + j and sees positions
// 0 .. L - n + j (bottom-right causal).
//
// Grid: one task per (query tile of up to query_tile tokens of one sequence, KV head). A
// task's rows are its tokens x the KV head's query heads (row = token * group + head), at
// most kVarlenRows, padded to whole vectors: every per-row quantity lives across the vector
// lanes, so the task never transposes K or V and never reduces across lanes. It walks the
// tile's visible context in chunks of kVarlenKvChunk tokens with an online softmax:
//   1. convert the chunk's keys to float32 as K [token, head dim] (the cache's 16-byte
//      chunks, vectorized) and its values as V [head dim, token] (the cache's rows,
//      vectorized): each element once per task, reused by every row;
//   2. P^T [token, row] = K q^T: 4 tokens x a few row vectors of accumulators, one
//      broadcast key element per row vector FMA;
//   3. ALiBi, the causal limit per lane (a row's position), running max, rescale factor,
//      probabilities and running sum, all lane-wise;
//   4. acc^T [head dim, row] = acc^T * rescale + V P^T: 4 dims x a few row vectors.
// Output: acc^T / sum * v_scale, transposed into out: bfloat16 rounded as torch's cast, or
// float32 (a float16 caller casts it). Limits as paged attention (attention_limits.h);
// rows per task <= kVarlenRows (attention_params.h).
#pragma once

namespace vllm_lite::cpu {
namespace {

// Register blocks: 4 tokens (P^T) or head dims (acc^T) x kRowVecs row vectors: 16
// accumulators with 32 AVX-512 registers, 8 with 16 AVX2 / SSE registers.
constexpr int64_t kBlock4 = 4;
constexpr int64_t kRowVecs = VW >= 16 ? 4 : 2;
static_assert(kVarlenKvChunk % kBlock4 == 0, "a chunk is whole token blocks");

// pt[t + i, r..] = sum_d k[t + i, d] * qt[d, r..] for i < 4 and NR row vectors from r.
template <int64_t NR>
VLLM_LITE_INLINE void scores_block(const float* k, const float* qt, int64_t dp, int64_t rp,
                                   float* pt, int64_t t, int64_t r) {
  FV acc[kBlock4][NR] = {};
  for (int64_t d = 0; d < dp; ++d) {
    FV q[NR];
    for (int64_t j = 0; j < NR; ++j) q[j] = load_vec<FV>(qt + d * rp + r + j * VW);
    for (int64_t i = 0; i < kBlock4; ++i) {
      const float kv = k[(t + i) * dp + d];
      for (int64_t j = 0; j < NR; ++j) acc[i][j] += kv * q[j];
    }
  }
  for (int64_t i = 0; i < kBlock4; ++i) {
    for (int64_t j = 0; j < NR; ++j) store_vec(pt + (t + i) * rp + r + j * VW, acc[i][j]);
  }
}

// acct[d + i, r..] = acct * alpha[r..] + sum_{t < ntok} v[d + i, t] * pt[t, r..], i < 4.
template <int64_t NR>
VLLM_LITE_INLINE void values_block(const float* v, const float* pt, const float* alpha,
                                   int64_t rp, int64_t ntok, float* acct, int64_t d, int64_t r) {
  constexpr int64_t C = kVarlenKvChunk;
  FV acc[kBlock4][NR];
  for (int64_t j = 0; j < NR; ++j) {
    const FV a = load_vec<FV>(alpha + r + j * VW);
    for (int64_t i = 0; i < kBlock4; ++i) {
      acc[i][j] = load_vec<FV>(acct + (d + i) * rp + r + j * VW) * a;
    }
  }
  for (int64_t t = 0; t < ntok; ++t) {
    FV p[NR];
    for (int64_t j = 0; j < NR; ++j) p[j] = load_vec<FV>(pt + t * rp + r + j * VW);
    for (int64_t i = 0; i < kBlock4; ++i) {
      const float vv = v[(d + i) * C + t];
      for (int64_t j = 0; j < NR; ++j) acc[i][j] += vv * p[j];
    }
  }
  for (int64_t i = 0; i < kBlock4; ++i) {
    for (int64_t j = 0; j < NR; ++j) store_vec(acct + (d + i) * rp + r + j * VW, acc[i][j]);
  }
}

// Converts n contiguous cache elements to float32, whole vectors first.
template <typename E>
VLLM_LITE_INLINE void convert_run(const typename E::T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) store_vec(dst + i, E::template load<VW>(src + i));
  for (; i < n; ++i) dst[i] = E::to_float(src[i]);
}

// One task's tile: its sequence, KV head, query rows and visible context, and its
// scratch sections (varlen_scratch_floats: qt | k | v | pt | acct | m | l | alpha | qpos |
// row), shared by varlen_task and the AVX512-BF16 build's bf16 task (which keeps bf16 in
// the first sections).
struct VarlenTile {
  int64_t kh, s, q_first, n, j0, nq, G, h0, D, Dp, bs, rows, rp, pos0, ctx_end, block_stride;
  const int32_t* table;
  float *qt, *k, *v, *pt, *acct, *m, *l, *alpha, *qpos, *row;

  VarlenTile(const VarlenParams& p, int64_t task, float* scratch) {
    const int64_t tile = task / p.num_kv_heads;
    kh = task % p.num_kv_heads;
    s = p.tile_seq[tile];
    q_first = p.query_start_loc[s];
    n = p.query_start_loc[s + 1] - q_first;  // the sequence's query tokens
    j0 = p.tile_start[tile];
    nq = n - j0 < p.query_tile ? n - j0 : p.query_tile;
    G = p.num_heads / p.num_kv_heads;
    h0 = kh * G;
    D = p.head_size;
    Dp = padded_head_size(D);
    bs = p.block_size;
    rows = nq * G;
    rp = (rows + VW - 1) / VW * VW;  // <= varlen_rows_padded(p)
    pos0 = p.seq_lens[s] - n + j0;   // position of the tile's first query token
    ctx_end = pos0 + nq;             // the tile sees positions [0, ctx_end)
    table = p.block_tables + s * p.max_blocks_per_seq;
    block_stride = p.num_kv_heads * D * bs;
    const int64_t rmax = varlen_rows_padded(p), C = kVarlenKvChunk;
    qt = scratch;
    k = qt + Dp * rmax;
    v = k + C * Dp;
    pt = v + Dp * C;
    acct = pt + C * rmax;
    m = acct + Dp * rmax;
    l = m + rmax;
    alpha = l + rmax;
    qpos = alpha + rmax;
    row = qpos + rmax;
  }

  // Row r's query token (flat over sequences) and query head.
  int64_t token(int64_t r) const { return q_first + j0 + r / G; }
  int64_t head(int64_t r) const { return h0 + r % G; }

  // Every row's accumulator before the first chunk: zero, in one contiguous pass (a
  // strided pass per row showed in a bf16 prefill's profile).
  void zero_acc() { std::memset(acct, 0, static_cast<size_t>(Dp * rp) * sizeof(float)); }

  // Row r's running state before the first chunk: position (padding rows: the last
  // row's, so their discarded lanes stay finite), max, sum (zero_acc: the accumulator).
  void init_row(int64_t r) {
    qpos[r] = static_cast<float>(pos0 + (r < rows ? r : rows - 1) / G);
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }

  // fn(element offset of the block in a cache, first token's offset in the block, its index
  // in the chunk, tokens) for each block run of the chunk at c0 (cnt tokens).
  template <typename Fn>
  void for_each_run(int64_t c0, int64_t cnt, Fn&& fn) const {
    for (int64_t t = 0; t < cnt;) {
      const int64_t pos = c0 + t, off = pos % bs;
      const int64_t run = bs - off < cnt - t ? bs - off : cnt - t;
      fn(table[pos / bs] * block_stride, off, t, run);
      t += run;
    }
  }

  // Tokens of the chunk at c0 (cnt of them) that any row sees.
  int64_t visible(int64_t c0, int64_t cnt) const {
    const int64_t last = static_cast<int64_t>(qpos[rp - 1]) + 1 - c0;
    return last < cnt ? last : cnt;
  }

  // Step 3 on the scores P^T [token, row] of the chunk at c0 (pv_end tokens): ALiBi, the
  // causal limit per lane (a row's position), running max, rescale factor (alpha),
  // probabilities in place and running sum, all lane-wise.
  void online_softmax(const float* slopes, int64_t c0, int64_t pv_end) {
    for (int64_t r = 0; r < rp; r += VW) {
      const FV pos = load_vec<FV>(qpos + r);
      FV slope = {};
      if (slopes != nullptr) {
        for (int64_t i = 0; i < VW; ++i) slope[i] = r + i < rows ? slopes[h0 + (r + i) % G] : 0.0f;
      }
      FV cm = FV{} - INFINITY;
      for (int64_t t = 0; t < pv_end; ++t) {
        const float tp = static_cast<float>(c0 + t);
        FV x = load_vec<FV>(pt + t * rp + r);
        if (slopes != nullptr) x += slope * (tp - pos);
        x = tp <= pos ? x : FV{} - INFINITY;
        store_vec(pt + t * rp + r, x);
        cm = x > cm ? x : cm;
      }
      const FV mo = load_vec<FV>(m + r);
      const FV mn = cm > mo ? cm : mo;
      // exp(-inf) flushes to ~1e-38, harmless: it scales a zero accumulator and sum.
      const FV a = exp_nonpositive<FV, Vec<int32_t, VW>>(mo - mn);
      FV sum = {};
      for (int64_t t = 0; t < pv_end; ++t) {
        const float tp = static_cast<float>(c0 + t);
        const FV e = exp_nonpositive<FV, Vec<int32_t, VW>>(load_vec<FV>(pt + t * rp + r) - mn);
        const FV pr = tp <= pos ? e : FV{};
        store_vec(pt + t * rp + r, pr);
        sum += pr;
      }
      store_vec(m + r, mn);
      store_vec(alpha + r, a);
      store_vec(l + r, load_vec<FV>(l + r) * a + sum);
    }
  }

  // Output: acc^T / sum * v_scale, transposed into out (float32, or bf16 bits rounded as
  // torch's cast). Dims outer, rows across the lanes, so acc^T is read contiguously, not
  // with one strided read per element (row outer).
  void write_out(const VarlenParams& p) const {
    if (p.out_bf16 != nullptr) return write_rows(p, p.out_bf16);
    write_rows(p, p.out);
  }

  template <typename O>
  void write_rows(const VarlenParams& p, O* out) const {
    static_assert(kMaxQueryHeadsPerKvHead <= kVarlenRows && kVarlenRows % VW == 0,
                  "rp <= kVarlenRows");
    O* outs[kVarlenRows];
    alignas(64) float f[kVarlenRows];
    for (int64_t r = 0; r < rp; ++r) {
      outs[r] = r < rows ? out + (token(r) * p.num_heads + head(r)) * D : nullptr;
      f[r] = r < rows ? p.v_scale / l[r] : 0.0f;
    }
    for (int64_t d = 0; d < D; ++d) {
      const float* a = acct + d * rp;
      for (int64_t r = 0; r < rows; r += VW) {
        const FV v = load_vec<FV>(a + r) * load_vec<FV>(f + r);
        const int64_t lanes = rows - r < VW ? rows - r : VW;
        if constexpr (std::is_same_v<O, float>) {
          for (int64_t i = 0; i < lanes; ++i) outs[r + i][d] = v[i];
        } else {
          const Vec<uint32_t, VW> bits = bf16_bits<Vec<uint32_t, VW>>(v);
          for (int64_t i = 0; i < lanes; ++i) outs[r + i][d] = static_cast<uint16_t>(bits[i]);
        }
      }
    }
  }
};

template <KvDType DT, bool Flash>
void varlen_task(const VarlenParams& p, int64_t task, float* scratch) {
  using E = Elem<DT>;
  using T = typename E::T;
  constexpr int64_t X = 16 / sizeof(T);
  constexpr int64_t CW = X < VW ? X : VW;
  constexpr int64_t C = kVarlenKvChunk;

  VarlenTile g(p, task, scratch);
  const int64_t D = g.D, Dp = g.Dp, bs = g.bs, rows = g.rows, rp = g.rp;
  const T* kc = static_cast<const T*>(p.key_cache) + kv_head_offset(Flash, g.kh, D, bs);
  const T* vc = static_cast<const T*>(p.value_cache) + kv_head_offset(Flash, g.kh, D, bs);
  const int64_t ts = kv_flash_token_stride(p.num_kv_heads, D);  // flash layout only
  float* qt = g.qt;
  float* k = g.k;
  float* v = g.v;
  float* pt = g.pt;
  float* row = g.row;

  // q^T scaled; padding lanes get zero queries and the last row's position, so their
  // (discarded) lanes stay finite.
  const int64_t q_elem = p.q_dtype == KvDType::kFloat32 ? 4 : 2;
  for (int64_t r = 0; r < rp; ++r) {
    if (r < rows) {
      const int64_t off = g.token(r) * p.q_stride_token + g.head(r) * p.q_stride_head;
      load_query_row(p.q_dtype, static_cast<const char*>(p.query) + off * q_elem, D, p.scale,
                     row);
    }
    for (int64_t d = 0; d < Dp; ++d) qt[d * rp + r] = r < rows && d < D ? row[d] : 0.0f;
    g.init_row(r);
  }
  g.zero_acc();
  // Head-dim padding of K and V stays zero. Token rows of K past a short last chunk hold
  // the previous chunk's finite values (or zeros): their scores are masked out.
  for (int64_t i = 0; i < C * Dp; ++i) k[i] = 0.0f;
  for (int64_t i = 0; i < Dp * C; ++i) v[i] = 0.0f;

  for (int64_t c0 = 0; c0 < g.ctx_end; c0 += C) {
    const int64_t cnt = g.ctx_end - c0 < C ? g.ctx_end - c0 : C;
    // 1. Convert the chunk, block run by block run.
    g.for_each_run(c0, cnt, [&](int64_t at, int64_t off, int64_t t, int64_t run) {
      const T* kb = kc + at;
      const T* vb = vc + at;
      if constexpr (Flash) {
        // A token's keys and values are contiguous rows; V^T takes each value row apart
        // (through `row`, free once q^T is built).
        for (int64_t i = 0; i < run; ++i) {
          convert_run<E>(kb + (off + i) * ts, D, k + (t + i) * Dp);
          convert_run<E>(vb + (off + i) * ts, D, row);
          for (int64_t d = 0; d < D; ++d) v[d * C + t + i] = row[d];
        }
        return;
      }
      for (int64_t i = 0; i < run; ++i) {
        float* kr = k + (t + i) * Dp;
        for (int64_t c = 0; c < D / X; ++c) {
          const T* src = kb + (c * bs + off + i) * X;
          for (int64_t j = 0; j < X; j += CW) {
            store_vec(kr + c * X + j, E::template load<CW>(src + j));
          }
        }
      }
      for (int64_t d = 0; d < D; ++d) convert_run<E>(vb + d * bs + off, run, v + d * C + t);
    });
    const int64_t ntok = (cnt + kBlock4 - 1) / kBlock4 * kBlock4;

    // 2. Scores P^T [token, row].
    for (int64_t t = 0; t < ntok; t += kBlock4) {
      int64_t r = 0;
      for (; r + kRowVecs * VW <= rp; r += kRowVecs * VW) {
        scores_block<kRowVecs>(k, qt, Dp, rp, pt, t, r);
      }
      for (; r < rp; r += VW) scores_block<1>(k, qt, Dp, rp, pt, t, r);
    }

    // 3. Online softmax, lane-wise. A lane's token t counts iff c0 + t <= its position.
    const int64_t pv_end = g.visible(c0, cnt);
    g.online_softmax(p.alibi_slopes, c0, pv_end);

    // 4. acc^T = acc^T * alpha + V P^T.
    for (int64_t d = 0; d < Dp; d += kBlock4) {
      int64_t r = 0;
      for (; r + kRowVecs * VW <= rp; r += kRowVecs * VW) {
        values_block<kRowVecs>(v, pt, g.alpha, rp, pv_end, g.acct, d, r);
      }
      for (; r < rp; r += VW) values_block<1>(v, pt, g.alpha, rp, pv_end, g.acct, d, r);
    }
  }

  g.write_out(p);
}

}  // namespace
}  // namespace vllm_lite::cpu

#ifdef VLLM_LITE_BF16_DOT
#include "cpu/varlen_bf16dp.h"
#endif

namespace vllm_lite::cpu {
namespace {

void run_varlen_task(const VarlenParams& p, int64_t task, float* scratch) {
  if (p.flash_layout) {
    switch (p.cache_dtype) {
      case KvDType::kFp8E4M3: return varlen_task<KvDType::kFp8E4M3, true>(p, task, scratch);
      case KvDType::kFp8E5M2: return varlen_task<KvDType::kFp8E5M2, true>(p, task, scratch);
      case KvDType::kFloat32: return varlen_task<KvDType::kFloat32, true>(p, task, scratch);
      case KvDType::kFloat16: return varlen_task<KvDType::kFloat16, true>(p, task, scratch);
      case KvDType::kBFloat16: return varlen_task<KvDType::kBFloat16, true>(p, task, scratch);
    }
  }
  switch (p.cache_dtype) {
    case KvDType::kFp8E4M3: return varlen_task<KvDType::kFp8E4M3, false>(p, task, scratch);
    case KvDType::kFp8E5M2: return varlen_task<KvDType::kFp8E5M2, false>(p, task, scratch);
    case KvDType::kFloat32: return varlen_task<KvDType::kFloat32, false>(p, task, scratch);
    case KvDType::kFloat16: return varlen_task<KvDType::kFloat16, false>(p, task, scratch);
    case KvDType::kBFloat16:
#ifdef VLLM_LITE_BF16_DOT
      return varlen_task_bf16dp(p, task, scratch);  // the query is bf16 too (validate.cpp)
#else
      return varlen_task<KvDType::kBFloat16, false>(p, task, scratch);
#endif
  }
}

}  // namespace

VarlenTaskFn VLLM_LITE_VARLEN_ISA_FN() { return &run_varlen_task; }

}  // namespace vllm_lite::cpu
