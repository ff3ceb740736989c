// CPU varlen paged-attention (prefill) kernel body, compiled once per instruction set like
// attention_kernel.h, whose helpers it uses: each attention_<isa>.cpp includes that file,
// sets VLLM_LITE_VARLEN_ISA_FN, then includes this one.
//
// Layouts: query [num_tokens, num_heads, head_size] flat over sequences (sequence i's rows
// are query_start_loc[i] .. query_start_loc[i + 1]); the caches in the paged layouts of
// attention_kernel.h (the new tokens' K/V already written). Query token j of a sequence
// with n new tokens and context length L sits at position L - n + j and sees positions
// 0 .. L - n + j (bottom-right causal).
//
// Grid: one task per (query tile of up to query_tile tokens of one sequence, KV head); a
// task's rows are its tokens x the KV head's query heads (row = token * group + head), at
// most kVarlenRows. It walks the tile's visible context in chunks of kVarlenKvChunk
// tokens with an online softmax:
//   1. gather the chunk's keys as K^T [head, token] and values as V [token, head] in
//      float32 (each cache element converted once per task, then reused by every row);
//   2. logits [rows, chunk] = q K^T by register-blocked outer products (4 rows x 2
//      vectors of tokens), scaled, ALiBi added, positions past each row's causal limit
//      excluded;
//   3. per row: new running max, rescale factor, probabilities, running sum;
//   4. acc [rows, head] = acc * rescale + P V, again 4 rows x a few vectors of head dims.
// Output: acc / sum * v_scale in float32 (the caller casts to the query dtype). Limits as
// paged attention (attention_limits.h); rows per task <= kVarlenRows (attention_params.h)
// except when one KV head has more query heads than that, then one token per task.
#pragma once

namespace vllm_lite::cpu {
namespace {

// Register blocks: rows per block, and vectors per block of tokens (logits) or head dims
// (accumulators). 4 x 2 (or 4 x 4 with 32 AVX-512 registers) accumulators stay in registers.
constexpr int64_t kRowBlock = 4;  // the remainder switches below cover 1-3 rows
constexpr int64_t kHeadVecs = VW >= 16 ? 4 : 2;
static_assert(kVarlenKvChunk % (2 * 16) == 0, "a chunk is whole pairs of the widest vectors");

// logits[r, t] = sum_d q[r, d] * kt[d, t] for RB rows and tokens [0, ntok), ntok a multiple
// of 2 * VW; kt rows are kVarlenKvChunk floats apart.
template <int64_t RB>
VLLM_LITE_INLINE void qk_rows(const float* q, int64_t dp, const float* kt, int64_t ntok,
                              float* logits) {
  constexpr int64_t C = kVarlenKvChunk;
  for (int64_t t = 0; t < ntok; t += 2 * VW) {
    FV acc[RB][2] = {};
    for (int64_t d = 0; d < dp; ++d) {
      const FV k0 = load_vec<FV>(kt + d * C + t);
      const FV k1 = load_vec<FV>(kt + d * C + t + VW);
      for (int64_t r = 0; r < RB; ++r) {
        const float qv = q[r * dp + d];
        acc[r][0] += qv * k0;
        acc[r][1] += qv * k1;
      }
    }
    for (int64_t r = 0; r < RB; ++r) {
      store_vec(logits + r * C + t, acc[r][0]);
      store_vec(logits + r * C + t + VW, acc[r][1]);
    }
  }
}

// acc[r, d..d + NV * VW) = acc * alpha[r] + sum_{t < ntok} p[r, t] * v[t, d..] for RB rows.
template <int64_t RB, int64_t NV>
VLLM_LITE_INLINE void pv_rows(const float* probs, const float* v, int64_t dp, int64_t ntok,
                              const float* alpha, float* acc, int64_t d) {
  constexpr int64_t C = kVarlenKvChunk;
  FV a[RB][NV];
  for (int64_t r = 0; r < RB; ++r) {
    for (int64_t j = 0; j < NV; ++j) a[r][j] = load_vec<FV>(acc + r * dp + d + j * VW) * alpha[r];
  }
  for (int64_t t = 0; t < ntok; ++t) {
    FV vv[NV];
    for (int64_t j = 0; j < NV; ++j) vv[j] = load_vec<FV>(v + t * dp + d + j * VW);
    for (int64_t r = 0; r < RB; ++r) {
      const float pr = probs[r * C + t];
      for (int64_t j = 0; j < NV; ++j) a[r][j] += pr * vv[j];
    }
  }
  for (int64_t r = 0; r < RB; ++r) {
    for (int64_t j = 0; j < NV; ++j) store_vec(acc + r * dp + d + j * VW, a[r][j]);
  }
}

template <int64_t RB>
VLLM_LITE_INLINE void pv_block(const float* probs, const float* v, int64_t dp, int64_t ntok,
                               const float* alpha, float* acc) {
  int64_t d = 0;
  for (; d + kHeadVecs * VW <= dp; d += kHeadVecs * VW) {
    pv_rows<RB, kHeadVecs>(probs, v, dp, ntok, alpha, acc, d);
  }
  for (; d < dp; d += VW) pv_rows<RB, 1>(probs, v, dp, ntok, alpha, acc, d);
}

template <KvDType DT>
void varlen_task(const VarlenParams& p, int64_t task, float* scratch) {
  using E = Elem<DT>;
  using T = typename E::T;
  constexpr int64_t X = 16 / sizeof(T);
  constexpr int64_t C = kVarlenKvChunk;

  const int64_t tile = task / p.num_kv_heads, kh = task % p.num_kv_heads;
  const int64_t s = p.tile_seq[tile];
  const int64_t q_first = p.query_start_loc[s];
  const int64_t n = p.query_start_loc[s + 1] - q_first;  // the sequence's query tokens
  const int64_t j0 = p.tile_start[tile];
  const int64_t nq = n - j0 < p.query_tile ? n - j0 : p.query_tile;
  const int64_t L = p.seq_lens[s];
  const int64_t G = p.num_heads / p.num_kv_heads, h0 = kh * G;
  const int64_t D = p.head_size, Dp = padded_head_size(D), bs = p.block_size;
  const int64_t rows = nq * G;
  const int64_t pos0 = L - n + j0;     // position of the tile's first query token
  const int64_t ctx_end = pos0 + nq;   // the tile sees positions [0, ctx_end)
  const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
  const int64_t block_stride = p.num_kv_heads * D * bs;
  const T* kc = static_cast<const T*>(p.key_cache) + kh * D * bs;
  const T* vc = static_cast<const T*>(p.value_cache) + kh * D * bs;

  // Scratch (varlen_scratch_floats): q | kt | v | logits | acc | m | l | alpha.
  float* q = scratch;
  float* kt = q + rows * Dp;
  float* v = kt + Dp * C;
  float* logits = v + C * Dp;
  float* acc = logits + rows * C;
  float* m = acc + rows * Dp;
  float* l = m + rows;
  float* alpha = l + rows;

  const int64_t q_elem = p.q_dtype == KvDType::kFloat32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_first + j0 + r / G, h = h0 + r % G;
    const int64_t off = tok * p.q_stride_token + h * p.q_stride_head;
    load_query_row(p.q_dtype, static_cast<const char*>(p.query) + off * q_elem, D, p.scale,
                   q + r * Dp);
    for (int64_t d = D; d < Dp; ++d) q[r * Dp + d] = 0.0f;
    for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] = 0.0f;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Padding dims of K^T and V stay zero. Token columns past a short last chunk hold the
  // previous chunk's finite values: their logits are computed and then discarded.
  for (int64_t i = 0; i < Dp * C; ++i) kt[i] = 0.0f;
  for (int64_t i = 0; i < C * Dp; ++i) v[i] = 0.0f;

  for (int64_t c0 = 0; c0 < ctx_end; c0 += C) {
    const int64_t cnt = ctx_end - c0 < C ? ctx_end - c0 : C;
    // 1. Gather and convert the chunk, block run by block run.
    for (int64_t t = 0; t < cnt;) {
      const int64_t pos = c0 + t;
      const int64_t block = table[pos / bs], off = pos % bs;
      const int64_t run = bs - off < cnt - t ? bs - off : cnt - t;
      const T* kb = kc + block * block_stride;
      const T* vb = vc + block * block_stride;
      for (int64_t i = 0; i < run; ++i) {
        for (int64_t d = 0; d < D; ++d) {
          kt[d * C + t + i] = E::to_float(kb[(d / X) * bs * X + (off + i) * X + d % X]);
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        const T* vrow = vb + d * bs + off;
        for (int64_t i = 0; i < run; ++i) v[(t + i) * Dp + d] = E::to_float(vrow[i]);
      }
      t += run;
    }
    const int64_t ntok = (cnt + 2 * VW - 1) / (2 * VW) * (2 * VW);

    // 2. Logits.
    int64_t r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock) {
      qk_rows<kRowBlock>(q + r * Dp, Dp, kt, ntok, logits + r * C);
    }
    switch (rows - r) {
      case 3: qk_rows<3>(q + r * Dp, Dp, kt, ntok, logits + r * C); break;
      case 2: qk_rows<2>(q + r * Dp, Dp, kt, ntok, logits + r * C); break;
      case 1: qk_rows<1>(q + r * Dp, Dp, kt, ntok, logits + r * C); break;
      default: break;
    }

    // 3. Online softmax per row; rows whose causal limit lies before the chunk keep
    // their state (alpha 1, probabilities 0).
    int64_t pv_end = 0;  // tokens of the chunk any row sees
    for (r = 0; r < rows; ++r) {
      float* lg = logits + r * C;
      const int64_t qpos = pos0 + r / G;
      const int64_t nv = qpos + 1 - c0 < cnt ? qpos + 1 - c0 : cnt;
      if (nv <= 0) {
        alpha[r] = 1.0f;
        for (int64_t t = 0; t < ntok; ++t) lg[t] = 0.0f;
        continue;
      }
      pv_end = nv > pv_end ? nv : pv_end;
      if (p.alibi_slopes != nullptr) {
        const float slope = p.alibi_slopes[h0 + r % G];
        for (int64_t t = 0; t < nv; ++t) lg[t] += slope * static_cast<float>(c0 + t - qpos);
      }
      const float cm = max_of(lg, nv);
      const float mn = cm > m[r] ? cm : m[r];
      alpha[r] = std::exp(m[r] - mn);  // 0 on the first chunk (m = -inf)
      m[r] = mn;
      const int64_t nvv = (nv + VW - 1) / VW * VW;
      for (int64_t t = nv; t < nvv; ++t) lg[t] = mn;  // finite, zeroed after the exp
      FV sum = {};
      for (int64_t t = 0; t < nvv; t += VW) {
        const FV e = exp_nonpositive<FV, Vec<int32_t, VW>>(load_vec<FV>(lg + t) - mn);
        store_vec(lg + t, e);
        sum += e;
      }
      for (int64_t t = nv; t < nvv; ++t) sum[0] -= lg[t];
      for (int64_t t = nv; t < ntok; ++t) lg[t] = 0.0f;
      l[r] = l[r] * alpha[r] + hsum(sum);
    }

    // 4. acc = acc * alpha + P V over the tokens any row sees.
    for (r = 0; r + kRowBlock <= rows; r += kRowBlock) {
      pv_block<kRowBlock>(logits + r * C, v, Dp, pv_end, alpha + r, acc + r * Dp);
    }
    switch (rows - r) {
      case 3: pv_block<3>(logits + r * C, v, Dp, pv_end, alpha + r, acc + r * Dp); break;
      case 2: pv_block<2>(logits + r * C, v, Dp, pv_end, alpha + r, acc + r * Dp); break;
      case 1: pv_block<1>(logits + r * C, v, Dp, pv_end, alpha + r, acc + r * Dp); break;
      default: break;
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_first + j0 + r / G, h = h0 + r % G;
    float* o = p.out + (tok * p.num_heads + h) * D;
    const float f = p.v_scale / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * Dp + d] * f;
  }
}

void run_varlen_task(const VarlenParams& p, int64_t task, float* scratch) {
  switch (p.cache_dtype) {
    case KvDType::kFp8E4M3: return varlen_task<KvDType::kFp8E4M3>(p, task, scratch);
    case KvDType::kFp8E5M2: return varlen_task<KvDType::kFp8E5M2>(p, task, scratch);
    case KvDType::kFloat32: return varlen_task<KvDType::kFloat32>(p, task, scratch);
    case KvDType::kFloat16: return varlen_task<KvDType::kFloat16>(p, task, scratch);
    case KvDType::kBFloat16: return varlen_task<KvDType::kBFloat16>(p, task, scratch);
  }
}

}  // namespace

VarlenTaskFn VLLM_LITE_VARLEN_ISA_FN() { return &run_varlen_task; }

}  // namespace vllm_lite::cpu
