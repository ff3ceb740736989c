// Tensor-core varlen paged attention (prefill over the paged cache), in FlashAttention-2's
// form, for sm_80 and newer (the tensor-core instructions through cuda/mma.cuh). Same
// parameters (VarlenParams), grid semantics and outputs as varlen_paged_attention_kernel
// (varlen_attention_kernels.cuh: layouts, bottom-right causal semantics, clamping of
// unvalidated metadata); varlen_path (attention_path.h) decides which of the two a call
// runs.
//
// varlen_paged_attention_tc_kernel<T, CT, HEAD> (T = CT = half or bfloat16, HEAD = the
// head size, 64 or 128; block sizes 8 / 16 / 32; both cache layouts; ALiBi):
//   Rows   a CTA owns kVarlenTcRows = 64 query rows of ONE kv head: row r is (query token
//          j0 + r / heads_per_cta, query head head0 + r % heads_per_cta), so a K/V tile is
//          loaded once for all the heads of a GQA / MQA group (plan_varlen_rows: a group
//          larger than 64 is split over CTAs). Warp w owns rows 16 w .. 16 w + 15: the M
//          rows of its MMA tiles. Grid and the query tiles counted from the end of each
//          sequence: as the SIMT kernel.
//   Block  kVarlenTcThreads = 128 threads (4 warps).
//   Q      each warp's A fragments of Q (16 rows x HEAD) are loaded once into registers.
//   Stages the CTA's visible context [0, ctx_end) (ctx_end = position of its last query + 1)
//          is walked in KV tiles of TcVarlenLayout::kTokens tokens (64 for head size 64,
//          32 for 128: two stages of K and V stay under 48 KiB of static shared memory).
//          K and V tiles go global -> shared with 16-byte cp.async copies, zero-filled for
//          tokens past ctx_end and block ids outside the pool (a corrupt table never
//          faults), double-buffered: tile i + 1 is in flight while tile i is computed.
//          Shared K tile [tokens][HEAD + 8] (a token's 16-byte key chunks, either layout).
//          V: split layout (a block's tokens contiguous per dimension) -> V^T tile
//          [HEAD][tokens + 8], B fragments by ldmatrix; flash layout (a token's dims
//          contiguous) -> V tile [tokens][HEAD + 8], B fragments by ldmatrix .trans. The
//          8-element pads stagger the rows over the shared-memory banks for ldmatrix.
//   Math   per warp and tile: S = Q K^T (ldmatrix.x4 of K gives the B fragments of two
//          8-token tiles per 16-dim step, mma m16n8k16, fp32 accumulation); scale (in
//          log2 units, for exp2), ALiBi, bottom-right causal mask (token > the row's
//          position -> -inf) only in the tiles that reach past the warp's first row's
//          position; online softmax per row in registers (running max m and sum l, quad
//          shuffles); P (fp32 C fragments) -> the A fragments of P V in T; O += P V. A
//          warp skips tiles wholly past its last row's position (it still joins the
//          barriers and copies). Value slots past ctx_end in a split-layout chunk hold
//          whatever the cache has (NaN in the tests), and 0 * NaN = NaN inside the MMA,
//          so the last tile's B fragments are masked to 0 there.
//   Output out = o * v_scale / l (0 for a row that sees no position), from the C fragments.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../mma.cuh"
#include "varlen_attention_kernels.cuh"

namespace vllm_lite {
namespace cuda {
namespace varlen {

template <int HEAD>
struct TcVarlenLayout {
  static constexpr int kTokens = HEAD <= 64 ? 64 : 32;  // tokens of a KV tile
  static constexpr int kKRow = HEAD + 8;    // elements per shared K (and flash V) row
  static constexpr int kVtRow = kTokens + 8;  // elements per shared V^T row (split layout)
  static constexpr int kKElems = kTokens * kKRow;
  static constexpr int kVElems = HEAD * kVtRow > kKElems ? HEAD * kVtRow : kKElems;
  static constexpr int kStageElems = kKElems + kVElems;
  static constexpr int kBytes = 2 * kStageElems * 2;  // two stages of 16-bit elements
  static_assert(kBytes <= 48 * 1024, "static shared memory limit");
  static_assert((kKRow * 2) % 16 == 0 && (kVtRow * 2) % 16 == 0 && (kKElems * 2) % 16 == 0 &&
                    (kStageElems * 2) % 16 == 0,
                "ldmatrix rows and cp.async destinations 16-byte aligned");
};

template <typename T, typename CT, int HEAD>
__global__ void __launch_bounds__(kVarlenTcThreads)
    varlen_paged_attention_tc_kernel(const VarlenParams p) {
#if VLLM_LITE_TC_AVAILABLE
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "16-bit queries");
  static_assert(std::is_same_v<CT, T>, "caches in the query dtype");
  static_assert(HEAD == 64 || HEAD == 128, "head size");
  using Lay = TcVarlenLayout<HEAD>;
  constexpr int NT = kVarlenTcThreads;
  constexpr int TOK = Lay::kTokens;
  constexpr int X = 8;              // elements per 16-byte chunk (the key layout's x)
  constexpr int CPT = HEAD / X;     // chunks per token row
  constexpr int KSTEPS = HEAD / 16;  // k16 steps of Q K^T
  constexpr int STILES = TOK / 8;    // 8-token tiles of S
  constexpr int PSTEPS = TOK / 16;   // k16 steps of P V
  constexpr int OTILES = HEAD / 8;   // 8-dim tiles of O
  constexpr float kLog2e = 1.4426950408889634f;

  __shared__ __align__(16) unsigned char smem_raw[Lay::kBytes];
  T* const stage_base = reinterpret_cast<T*>(smem_raw);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // MMA row group (rows g, g + 8)
  const int t4 = lane & 3;  // thread in group (columns 2 t4, 2 t4 + 1)
  const int mat = lane >> 3, mrow = lane & 7;  // ldmatrix: the matrix and row this lane addresses

  // ---- CTA -> (query tile k from the end, sequence, kv head, head chunk), as the SIMT kernel
  const int per_tile = p.num_seqs * p.num_kv_heads * p.head_chunks;
  const int k = static_cast<int>(blockIdx.x) / per_tile;
  int rem = static_cast<int>(blockIdx.x) - k * per_tile;
  const int chunk = rem % p.head_chunks;
  rem /= p.head_chunks;
  const int kvh = rem % p.num_kv_heads;
  const int seq = rem / p.num_kv_heads;

  const int64_t q_first =
      min(max(static_cast<int64_t>(p.query_start_loc[seq]), int64_t{0}), p.num_tokens);
  const int64_t q_end =
      min(max(static_cast<int64_t>(p.query_start_loc[seq + 1]), q_first), p.num_tokens);
  const int64_t n = q_end - q_first;
  const int64_t j_hi = n - static_cast<int64_t>(k) * p.query_tile;
  if (j_hi <= 0) return;  // CTA-uniform: before any barrier
  const int64_t j_lo = max(j_hi - p.query_tile, int64_t{0});
  const int nq = static_cast<int>(j_hi - j_lo);
  const int L = min(max(p.seq_lens[seq], 0), p.max_tokens);
  const int64_t pos_lo = L - n + j_lo;  // position of the tile's first query (< 0: n > L)
  const int ctx_end = static_cast<int>(min(max(L - n + j_hi, int64_t{0}), int64_t{L}));

  const int hpc = p.heads_per_cta;
  const int hc = min(hpc, p.group_size - chunk * hpc);  // query heads of this CTA
  const int head0 = kvh * p.group_size + chunk * hpc;   // its first query head
  const int BS = p.block_size;

  // ---- this lane's two rows (g and g + 8 of the warp's tile)
  bool has[2];
  int qpos[2];       // position; -1: sees nothing
  int64_t orow[2];   // (token, head) row of query / out
  float slope[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    const int jr = row / hpc;
    const int h = row - jr * hpc;
    has[r] = jr < nq && h < hc;
    qpos[r] = has[r] ? static_cast<int>(max(pos_lo + jr, int64_t{-1})) : -1;
    orow[r] = (q_first + j_lo + jr) * p.num_heads + head0 + h;
    if (has[r] && p.alibi_slopes != nullptr) slope[r] = p.alibi_slopes[head0 + h] * kLog2e;
  }
  // The warp's first and last query token: the positions its rows span (warp-uniform).
  const int jr_first = warp * 16 / hpc;
  const int jr_last = min((warp * 16 + 15) / hpc, nq - 1);
  const int64_t warp_lo = pos_lo + jr_first;
  const int64_t warp_hi = jr_first < nq ? pos_lo + jr_last : int64_t{-1};

  // ---- Q's A fragments for every 16-dim step (rows of no query: zeros)
  uint32_t qa[KSTEPS][4];
  {
    const T* qrow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + 8 * r;
      const int jr = row / hpc;
      qrow[r] = static_cast<const T*>(p.query);
      if (has[r]) {
        qrow[r] += (q_first + j_lo + jr) * p.q_stride_token +
                   static_cast<int64_t>(head0 + row - jr * hpc) * p.q_stride_head;
      }
    }
    auto qpair = [&](int r, int d) -> uint32_t {
      if (!has[r]) return 0u;
      return tc::pack2<T>(to_float(qrow[r][d]), to_float(qrow[r][d + 1]));
    };
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      qa[s][0] = qpair(0, s * 16 + 2 * t4);
      qa[s][1] = qpair(1, s * 16 + 2 * t4);
      qa[s][2] = qpair(0, s * 16 + 8 + 2 * t4);
      qa[s][3] = qpair(1, s * 16 + 8 + 2 * t4);
    }
  }

  // ---- staging
  const bool flash = p.flash_layout;
  const int64_t head_offset = static_cast<int64_t>(kvh) * HEAD * (flash ? 1 : BS);
  const T* kc = static_cast<const T*>(p.key_cache) + head_offset;
  const T* vc = static_cast<const T*>(p.value_cache) + head_offset;
  // A token row's chunk c of token t of a block: t * k_tok + c * k_chunk elements in.
  const int64_t k_tok = flash ? p.kv_token_stride : X;
  const int64_t k_chunk = flash ? X : static_cast<int64_t>(BS) * X;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // Block id of context position pos (< ctx_end), -1 past ctx_end or when out of the pool.
  auto block_of = [&](int pos) {
    if (pos >= ctx_end) return -1;
    const int id = table[pos / BS];
    return (id >= 0 && id < p.num_blocks) ? id : -1;
  };
  // Issues the copies of KV tile s (tokens s * TOK ...) into buffer s & 1.
  auto issue_stage = [&](int s) {
    T* ks = stage_base + (s & 1) * Lay::kStageElems;
    T* vs = ks + Lay::kKElems;
    const int c0 = s * TOK;
    // Token rows: K (both layouts) and V (flash layout). Consecutive threads take the
    // consecutive 16-byte chunks in memory: a block's tokens for the split key layout
    // ([head/x][block][x]), a token's dims for the flash layout.
    for (int i = tid; i < TOK * CPT; i += NT) {
      const int t = flash ? i / CPT : i % TOK;
      const int c = flash ? i % CPT : i / TOK;
      const int pos = c0 + t;
      const int blk = block_of(pos);
      const int64_t off = static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride +
                          c * k_chunk + (pos % BS) * k_tok;
      tc::cp_async_16(ks + t * Lay::kKRow + c * X, blk < 0 ? kc : kc + off, blk >= 0);
      if (flash) tc::cp_async_16(vs + t * Lay::kKRow + c * X, blk < 0 ? vc : vc + off, blk >= 0);
    }
    if (!flash) {
      // V^T: 8 tokens (one 16-byte chunk of a value row; blocks are multiples of 8 tokens)
      // of dimension d -> row d.
      for (int i = tid; i < HEAD * (TOK / X); i += NT) {
        const int c8 = i % (TOK / X);
        const int d = i / (TOK / X);
        const int pos = c0 + c8 * X;
        const int blk = block_of(pos);
        const T* src = vc + static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride +
                       d * BS + pos % BS;
        tc::cp_async_16(vs + d * Lay::kVtRow + c8 * X, blk < 0 ? vc : src, blk >= 0);
      }
    }
  };

  float o[OTILES][4];
#pragma unroll
  for (int t = 0; t < OTILES; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[t][i] = 0.f;
  }
  float m_run[2] = {-INFINITY, -INFINITY};  // log2 units
  float l_run[2] = {0.f, 0.f};  // this lane's columns only; summed over the quad at the end
  const float scale2 = p.qk_scale * kLog2e;

  const int nstages = (ctx_end + TOK - 1) / TOK;
  if (nstages > 0) {
    issue_stage(0);
    tc::cp_async_commit();
  }
  for (int s = 0; s < nstages; ++s) {
    if (s + 1 < nstages) {
      issue_stage(s + 1);
      tc::cp_async_commit();
      tc::cp_async_wait<1>();  // tile s has landed (this thread's copies)
    } else {
      tc::cp_async_wait<0>();
    }
    __syncthreads();  // ... and every thread's

    const T* ks = stage_base + (s & 1) * Lay::kStageElems;
    const T* vs = ks + Lay::kKElems;
    const int c0 = s * TOK;
    if (c0 <= warp_hi) {  // warp-uniform: the warp's rows see some token of the tile
      // ---- S = Q K^T, 16 rows x TOK tokens
      float sc[STILES][4];
#pragma unroll
      for (int t = 0; t < STILES; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[t][i] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int t2 = 0; t2 < STILES / 2; ++t2) {
          // matrices: (tokens 0-7, dims lo), (tokens 0-7, dims hi), (8-15, lo), (8-15, hi)
          uint32_t kb[4];
          tc::ldmatrix_x4(kb, ks + (t2 * 16 + (mat >> 1) * 8 + mrow) * Lay::kKRow + kk * 16 +
                                  (mat & 1) * 8);
          const uint32_t b0[2] = {kb[0], kb[1]};
          const uint32_t b1[2] = {kb[2], kb[3]};
          tc::mma_m16n8k16<T>(sc[2 * t2], qa[kk], b0, sc[2 * t2]);
          tc::mma_m16n8k16<T>(sc[2 * t2 + 1], qa[kk], b1, sc[2 * t2 + 1]);
        }
      }
      // ---- scale, ALiBi, causal mask; row maxima over the quad
      // Tokens up to the warp's first position are visible to every row of the warp (and
      // lie before ctx_end): only a tile reaching past it needs the mask.
      const bool need_mask = c0 + TOK - 1 > warp_lo;  // warp-uniform
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int t = 0; t < STILES; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          const int tok = c0 + t * 8 + 2 * t4 + (i & 1);
          float v = sc[t][i] * scale2 + slope[r] * static_cast<float>(tok - qpos[r]);
          if (need_mask && tok > qpos[r]) v = -INFINITY;
          sc[t][i] = v;
          mx[r] = fmaxf(mx[r], v);
        }
      }
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m_run[r], mx[r]);
        // A row that has seen nothing yet (m_new = -inf) keeps o = l = 0.
        base[r] = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = m_run[r] == -INFINITY ? 0.f : exp2f(m_run[r] - base[r]);
        m_run[r] = m_new;
        l_run[r] *= alpha;
#pragma unroll
        for (int t = 0; t < OTILES; ++t) {
          o[t][2 * r] *= alpha;
          o[t][2 * r + 1] *= alpha;
        }
      }
#pragma unroll
      for (int t = 0; t < STILES; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          const float e = exp2f(sc[t][i] - base[r]);  // exp2(-inf) = 0
          sc[t][i] = e;
          l_run[r] += e;
        }
      }
      // ---- O += P V. P's C fragments of two token tiles are the A fragment of one k16 step.
      const bool tail = c0 + TOK > ctx_end;  // CTA-uniform
      auto mask_pair = [&](uint32_t v, int tok) -> uint32_t {
        const uint32_t lo = tok < ctx_end ? (v & 0xffffu) : 0u;
        const uint32_t hi = tok + 1 < ctx_end ? (v & 0xffff0000u) : 0u;
        return lo | hi;
      };
#pragma unroll
      for (int kk = 0; kk < PSTEPS; ++kk) {
        const uint32_t pa[4] = {
            tc::pack2<T>(sc[2 * kk][0], sc[2 * kk][1]), tc::pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
            tc::pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
            tc::pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int d2 = 0; d2 < HEAD / 16; ++d2) {
          // matrices: (dims 0-7, tokens 0-7), (dims 0-7, tokens 8-15), (dims 8-15, 0-7),
          // (8-15, 8-15): from V^T rows as they are, from V rows transposed.
          uint32_t vb[4];
          if (flash) {
            tc::ldmatrix_x4_trans(vb, vs + (kk * 16 + (mat & 1) * 8 + mrow) * Lay::kKRow +
                                          d2 * 16 + (mat >> 1) * 8);
          } else {
            tc::ldmatrix_x4(vb, vs + (d2 * 16 + (mat >> 1) * 8 + mrow) * Lay::kVtRow + kk * 16 +
                                    (mat & 1) * 8);
          }
          if (tail) {
            const int tok = c0 + kk * 16 + 2 * t4;
            vb[0] = mask_pair(vb[0], tok);
            vb[1] = mask_pair(vb[1], tok + 8);
            vb[2] = mask_pair(vb[2], tok);
            vb[3] = mask_pair(vb[3], tok + 8);
          }
          const uint32_t b0[2] = {vb[0], vb[1]};
          const uint32_t b1[2] = {vb[2], vb[3]};
          tc::mma_m16n8k16<T>(o[2 * d2], pa, b0, o[2 * d2]);
          tc::mma_m16n8k16<T>(o[2 * d2 + 1], pa, b1, o[2 * d2 + 1]);
        }
      }
    }
    __syncthreads();  // buffer s & 1 is refilled by the next iteration's copies
  }

  // ---- output: out = o * v_scale / l
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    if (!has[r]) continue;
    const float inv = l_run[r] > 0.f ? p.v_scale / l_run[r] : 0.f;
    T* out = static_cast<T*>(p.out) + orow[r] * HEAD + 2 * t4;
#pragma unroll
    for (int t = 0; t < OTILES; ++t) {
      out[t * 8] = from_float<T>(o[t][2 * r] * inv);
      out[t * 8 + 1] = from_float<T>(o[t][2 * r + 1] * inv);
    }
  }
#endif
}

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
