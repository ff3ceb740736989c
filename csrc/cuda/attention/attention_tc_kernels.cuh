// Tensor-core paged-attention decode kernel (sm_80 and newer; the tensor-core instructions
// through cuda/mma.cuh). Same parameters, grid semantics and outputs as
// paged_attention_kernel (attention_kernels.cuh: v1 writes out, v2 writes each partition's
// tmp_out / max_logits / exp_sums for the same reduce kernel); decode_path
// (attention_path.h) decides which of the two kernels a call runs.
//
// paged_attention_tc_kernel<T, CT, BLOCK_SIZE, HEAD> (T = half or bfloat16; CT = T, or an
// fp8 cache element, fp8_e4m3 / fp8_e5m2; HEAD = the head size, 64 or 128). Both cache
// layouts (p.flash_layout, a CTA-uniform branch): vLLM's split K [blocks, kv_heads,
// head / x, block, x] / V [blocks, kv_heads, head, block], and the flash layout K = V =
// [blocks, block, kv_heads, head].
//   Grid   x = num_seqs * num_kv_heads * ctas_per_kv_head, y = partitions (v1: 1). A CTA
//          serves up to 16 query heads of one kv head: they are the M rows of the MMA tile
//          (rows past the CTA's heads are zero queries whose results are dropped).
//   Block  tc_warps(HEAD) warps (attention_kernels.cuh: 4 for 64, 2 for 128). The CTA walks
//          its token range in stages of TcLayout::kTokens = 16 * warps tokens (one stage's
//          16-bit K and V are 16 KiB either way); warp w owns tokens [16 w, 16 w + 16) of
//          every stage and keeps its own online-softmax state (running max m and sum l per
//          row, o = 16 rows x HEAD in the MMA accumulator layout) over all stages.
//   Stage  K and V tiles of a stage go global -> shared with cp.async copies of 16 bytes (8
//          for the 8-byte value rows of an fp8 split cache at block size 8), zero-filled
//          for tokens past the range and for block ids outside the pool. Shared K tile
//          [tokens][HEAD + 8]; V tile: split layout V^T [HEAD][tokens + 8] (the value
//          layout keeps a block's tokens contiguous per dimension, so V^T lands as rows),
//          flash layout V [tokens][HEAD + 8] (a token's values are one row there) read
//          with ldmatrix .trans. The 8-element pad staggers the rows over the banks.
//          16-bit caches: two stages of tiles, stage i + 1 in flight while stage i is
//          computed. fp8 caches: cp.async cannot convert, so the copies land in two stages
//          of raw byte tiles (same orientation, unpadded) and after the wait every thread
//          converts 16 bytes at a time into ONE stage of 16-bit tiles (exact: e4m3 / e5m2
//          values are all representable in half and bfloat16; k_scale and v_scale stay
//          folded into qk_scale and the output scale), then the same MMA code reads them.
//          The raw double buffer keeps the next stage's global reads in flight during the
//          conversion and the math, as for 16-bit caches; one 16-bit stage (plus two raw
//          half-size stages) fits the 48 KiB of static shared memory, where two converted
//          stages would not, at the price of one more barrier per stage. Converting in
//          registers on the way in (plain loads instead of cp.async) would need the next
//          stage's bytes held in registers across the MMA loop.
//   Math   S = Q K^T: per 16-dim step one ldmatrix.x4 of K gives the B fragments of two
//          8-token tiles, Q's A fragments stay in registers for the whole kernel; then
//          scale, ALiBi, mask past the range (-inf), online softmax per row (quad shuffles),
//          P (float32 C fragments) -> the A fragment of P.V in T; O += P V with one
//          ldmatrix.x4 of V^T (or .trans of V) per 16 output dims. Value slots past the
//          range hold whatever the cache has (NaN in the tests), and 0 * NaN = NaN inside
//          the MMA, so the B fragments of the last stage are masked to 0 there.
//   End    the warps' states are merged through shared memory (reusing the stage buffers):
//          M = max_w m_w, L = sum_w l_w e^(m_w - M), out = sum_w o_w e^(m_w - M) * v_scale / L.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../mma.cuh"
#include "attention_kernels.cuh"

namespace vllm_lite {
namespace cuda {
namespace attn {

template <int HEAD, bool FP8>
struct TcLayout {
  static constexpr int kWarps = tc_warps(HEAD);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTokens = 16 * kWarps;  // tokens per stage
  static constexpr int kKRow = HEAD + 8;       // elements per shared K row (a token); flash V too
  static constexpr int kVtRow = kTokens + 8;   // elements per shared V^T row (a dimension)
  static constexpr int kKElems = kTokens * kKRow;
  static constexpr int kVElems = HEAD * kVtRow > kKElems ? HEAD * kVtRow : kKElems;
  static constexpr int kTileElems = kKElems + kVElems;  // one stage of 16-bit K and V tiles
  static constexpr int kTiles = FP8 ? 1 : 2;             // 16-bit stages
  static constexpr int kRawBytes = FP8 ? 2 * kTokens * HEAD : 0;  // one stage of fp8 K and V
  static constexpr int kRawOffset = kTiles * kTileElems * 2;       // bytes: after the tiles
  static constexpr int kBytes = kRawOffset + 2 * kRawBytes;
  // The merge of the warps' states reuses the stage buffers: o of every warp, in float.
  static_assert(kWarps * 16 * HEAD * 4 <= kBytes, "merge buffer fits the stage buffers");
  static_assert(kBytes + 2 * kWarps * 16 * 4 <= 48 * 1024, "static shared memory limit");
  static_assert((kKRow * 2) % 16 == 0 && (kVtRow * 2) % 16 == 0, "ldmatrix rows 16-byte aligned");
  static_assert(kRawOffset % 16 == 0 && kKElems % 8 == 0, "16-byte aligned tiles");
};

// Converts n16 16-byte chunks of fp8 rows (cols bytes each, contiguous) into 16-bit T rows of
// dpitch elements, thread tid of nt taking every nt-th chunk. Exact (see the header).
template <typename T, typename CT>
__device__ __forceinline__ void fp8_rows_to_tile(T* dst, int dpitch, const CT* src, int cols,
                                                 int n16, int tid, int nt) {
  using F = decltype(fp8_format(CT{}));
  const int per_row = cols / 16;
  for (int i = tid; i < n16; i += nt) {
    const int r = i / per_row;
    const int c = (i - r * per_row) * 16;
    const uint4 raw = *reinterpret_cast<const uint4*>(src + r * cols + c);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t o[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float f[4];
      fp8_word_to_float<F>(w[j], f);
      o[2 * j] = tc::pack2<T>(f[0], f[1]);
      o[2 * j + 1] = tc::pack2<T>(f[2], f[3]);
    }
    uint4* d = reinterpret_cast<uint4*>(dst + r * dpitch + c);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

template <typename T, typename CT, int BLOCK_SIZE, int HEAD>
__global__ void __launch_bounds__(tc_threads(HEAD))
    paged_attention_tc_kernel(const AttentionParams p) {
#if VLLM_LITE_TC_AVAILABLE
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "16-bit queries");
  constexpr bool FP8 = is_fp8_v<CT>;
  static_assert(std::is_same_v<CT, T> || FP8, "caches in the query dtype or fp8");
  static_assert(HEAD == 64 || HEAD == 128, "head size");
  using Lay = TcLayout<HEAD, FP8>;
  constexpr int BS = BLOCK_SIZE;
  constexpr int NT = Lay::kThreads;
  constexpr int TOK = Lay::kTokens;
  constexpr int X = kChunkElems<CT>;  // elements per 16-byte chunk (the key layout's x)
  constexpr int KC = HEAD / X;        // chunks of one key
  // A split-layout value row of a block is BS elements: copied in units of VX tokens, 16
  // bytes, or 8 for fp8 at block size 8 (a 16-byte copy would straddle two blocks).
  constexpr int VX = X < BS ? X : BS;
  constexpr int VC = TOK / VX;  // copies per V^T row of a stage
  constexpr int KSTEPS = HEAD / 16;
  constexpr int NTILES = HEAD / 8;  // 8-dim tiles of the output
  static_assert(TOK % BS == 0 && BS % VX == 0 && HEAD % X == 0,
                "stages are whole blocks, rows whole copies");
  static_assert(VX * sizeof(CT) == 16 || VX * sizeof(CT) == 8, "copy units");

  __shared__ __align__(16) unsigned char smem_raw[Lay::kBytes];
  __shared__ float m_w[Lay::kWarps][16];
  __shared__ float l_w[Lay::kWarps][16];
  T* const tiles = reinterpret_cast<T*>(smem_raw);
  // fp8: two stages of raw K [TOK][HEAD] then V ([HEAD][TOK] split, [TOK][HEAD] flash).
  CT* const raw = reinterpret_cast<CT*>(smem_raw + Lay::kRawOffset);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // MMA row group (rows g, g + 8)
  const int t4 = lane & 3;  // thread in group (columns 2 t4, 2 t4 + 1)

  const int ctas_per_seq = p.num_kv_heads * p.ctas_per_kv_head;
  const int seq = blockIdx.x / ctas_per_seq;
  const int rem = blockIdx.x - seq * ctas_per_seq;
  const int kvh = rem / p.ctas_per_kv_head;
  const int first = (rem - kvh * p.ctas_per_kv_head) * p.heads_per_cta;
  const int G = min(p.heads_per_cta, p.group_size - first);
  const int head0 = kvh * p.group_size + first;
  const int part = blockIdx.y;
  const bool is_v2 = p.exp_sums != nullptr;

  const int L = static_cast<int>(
      min(static_cast<int64_t>(max(p.seq_lens[seq], 0)), p.max_tokens));
  const int start = part * p.partition_tokens;
  if (is_v2 && start >= L) return;  // CTA-uniform: before any barrier
  const int end = static_cast<int>(
      min(static_cast<int64_t>(L), static_cast<int64_t>(start) + p.partition_tokens));
  const int nstages = (end - start + TOK - 1) / TOK;

  const bool flash = p.flash_layout;  // CTA-uniform
  const int64_t ts = p.kv_token_stride;
  const int64_t head_offset = static_cast<int64_t>(kvh) * HEAD * (flash ? 1 : BS);
  const CT* kc = static_cast<const CT*>(p.key_cache) + head_offset;
  const CT* vc = static_cast<const CT*>(p.value_cache) + head_offset;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // Pitches (elements) of the tiles the copies land in: 16-bit tiles, or fp8's raw ones.
  constexpr int kPitchK = FP8 ? HEAD : Lay::kKRow;  // K rows, and flash V rows
  constexpr int kPitchVt = FP8 ? TOK : Lay::kVtRow;  // split V^T rows

  // The pool block of token tok, or -1 past the range / outside the pool (reads as zeros).
  auto block_of = [&](int tok) -> int {
    if (tok >= end) return -1;
    const int id = table[tok / BS];
    return (id >= 0 && id < p.num_blocks) ? id : -1;
  };

  // Issues the copies of stage s (tokens start + s * TOK ...) into buffer s & 1.
  auto issue_stage = [&](int s) {
    CT* kd;
    if constexpr (FP8) {
      kd = raw + (s & 1) * Lay::kRawBytes;
    } else {
      kd = reinterpret_cast<CT*>(tiles + (s & 1) * Lay::kTileElems);
    }
    CT* vd = kd + (FP8 ? TOK * HEAD : Lay::kKElems);
    const int s0 = start + s * TOK;
    // K (and flash V): chunk dc of token t -> row t. Consecutive threads take consecutive
    // 16-byte chunks of the cache: split layout [head/x][block][x]: consecutive tokens of
    // one chunk column; flash layout: the chunks of one token's row.
    for (int i = tid; i < TOK * KC; i += NT) {
      const int t = flash ? i / KC : i % TOK;
      const int dc = flash ? i % KC : i / TOK;
      const int tok = s0 + t;
      const int blk = block_of(tok);
      const int64_t base = static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride;
      const int64_t off = flash ? (tok % BS) * ts + dc * X : dc * (BS * X) + (tok % BS) * X;
      tc::cp_async_16(kd + t * kPitchK + dc * X, blk < 0 ? kc : kc + base + off, blk >= 0);
      if (flash) {
        tc::cp_async_16(vd + t * kPitchK + dc * X, blk < 0 ? vc : vc + base + off, blk >= 0);
      }
    }
    if (!flash) {
      // V^T: VX tokens (one copy) of dimension d -> row d; tokens of a copy share a block.
      for (int i = tid; i < HEAD * VC; i += NT) {
        const int c = i % VC;
        const int d = i / VC;
        const int tok = s0 + c * VX;
        const int blk = block_of(tok);
        const CT* src = vc + static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride +
                        d * BS + tok % BS;
        CT* dst = vd + d * kPitchVt + c * VX;
        if constexpr (VX * sizeof(CT) == 16) {
          tc::cp_async_16(dst, blk < 0 ? vc : src, blk >= 0);
        } else {
          tc::cp_async_8(dst, blk < 0 ? vc : src, blk >= 0);
        }
      }
    }
  };

  // Q's A fragments for every 16-dim step (rows past the CTA's heads are zero).
  uint32_t qa[KSTEPS][4];
  {
    const T* q = static_cast<const T*>(p.query) + seq * p.q_stride_seq +
                 static_cast<int64_t>(head0) * p.q_stride_head;
    auto qpair = [&](int h, int d) -> uint32_t {
      if (h >= G) return 0u;
      const T* r = q + h * p.q_stride_head + d;
      return tc::pack2<T>(to_float(r[0]), to_float(r[1]));
    };
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      qa[k][0] = qpair(g, k * 16 + 2 * t4);
      qa[k][1] = qpair(g + 8, k * 16 + 2 * t4);
      qa[k][2] = qpair(g, k * 16 + 8 + 2 * t4);
      qa[k][3] = qpair(g + 8, k * 16 + 8 + 2 * t4);
    }
  }
  float slope[2] = {0.f, 0.f};
  if (p.alibi_slopes != nullptr) {
    if (g < G) slope[0] = p.alibi_slopes[head0 + g];
    if (g + 8 < G) slope[1] = p.alibi_slopes[head0 + g + 8];
  }

  float o[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;
  }
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this lane's columns only; summed over the quad at the end

  if (nstages > 0) {
    issue_stage(0);
    tc::cp_async_commit();
  }
  for (int s = 0; s < nstages; ++s) {
    if (s + 1 < nstages) {
      issue_stage(s + 1);
      tc::cp_async_commit();
      tc::cp_async_wait<1>();  // stage s has landed (this thread's copies)
    } else {
      tc::cp_async_wait<0>();
    }
    __syncthreads();  // ... and every thread's

    const T* ks = tiles;
    if constexpr (FP8) {
      // raw stage s -> the 16-bit tiles (the previous stage's readers passed the barrier at
      // the end of the last iteration).
      const CT* kr = raw + (s & 1) * Lay::kRawBytes;
      const CT* vr = kr + TOK * HEAD;
      fp8_rows_to_tile<T, CT>(tiles, Lay::kKRow, kr, HEAD, TOK * HEAD / 16, tid, NT);
      if (flash) {
        fp8_rows_to_tile<T, CT>(tiles + Lay::kKElems, Lay::kKRow, vr, HEAD, TOK * HEAD / 16,
                                tid, NT);
      } else {
        fp8_rows_to_tile<T, CT>(tiles + Lay::kKElems, Lay::kVtRow, vr, TOK, TOK * HEAD / 16,
                                tid, NT);
      }
      __syncthreads();
    } else {
      ks = tiles + (s & 1) * Lay::kTileElems;
    }
    const T* vs = ks + Lay::kKElems;
    const int w0 = warp * 16;               // the warp's first token in the stage
    const int tok0 = start + s * TOK + w0;  // its absolute position
    if (tok0 < end) {  // warp-uniform: a warp wholly past the range has nothing to add
      // ---- S = Q K^T for the warp's 16 tokens (two 8-token tiles).
      float sc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[n][i] = 0.f;
      }
      const int mat = lane >> 3, mrow = lane & 7;
#pragma unroll
      for (int k = 0; k < KSTEPS; ++k) {
        // matrices: (tokens 0-7, dims lo), (tokens 0-7, dims hi), (tokens 8-15, lo), (8-15, hi)
        uint32_t kb[4];
        tc::ldmatrix_x4(kb, ks + (w0 + (mat >> 1) * 8 + mrow) * Lay::kKRow + k * 16 + (mat & 1) * 8);
        const uint32_t b0[2] = {kb[0], kb[1]};
        const uint32_t b1[2] = {kb[2], kb[3]};
        tc::mma_m16n8k16<T>(sc[0], qa[k], b0, sc[0]);
        tc::mma_m16n8k16<T>(sc[1], qa[k], b1, sc[1]);
      }
      // ---- scale, ALiBi, mask; row maxima over the quad.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          const int tok = tok0 + n * 8 + 2 * t4 + (i & 1);
          float v = sc[n][i] * p.qk_scale + slope[r] * static_cast<float>(tok - L + 1);
          v = tok < end ? v : -INFINITY;
          sc[n][i] = v;
          mx[r] = fmaxf(mx[r], v);
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m_run[r], mx[r]);  // finite: the warp has a valid token
        alpha[r] = m_run[r] == -INFINITY ? 0.f : __expf(m_run[r] - m_new);
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      float pr[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          const float e = sc[n][i] == -INFINITY ? 0.f : __expf(sc[n][i] - m_run[r]);
          pr[n][i] = e;
          l_run[r] += e;
        }
      }
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
      // ---- O += P V. P's C fragments of the two token tiles are the A fragment of k16.
      const uint32_t pa[4] = {tc::pack2<T>(pr[0][0], pr[0][1]), tc::pack2<T>(pr[0][2], pr[0][3]),
                              tc::pack2<T>(pr[1][0], pr[1][1]), tc::pack2<T>(pr[1][2], pr[1][3])};
      // Value slots past the range (only in the range's last 16 tokens) -> 0.
      const bool tail = tok0 + 16 > end;  // warp-uniform
      auto mask_pair = [&](uint32_t v, int tok) -> uint32_t {
        const uint32_t lo = tok < end ? (v & 0xffffu) : 0u;
        const uint32_t hi = tok + 1 < end ? (v & 0xffff0000u) : 0u;
        return lo | hi;
      };
#pragma unroll
      for (int n2 = 0; n2 < HEAD / 16; ++n2) {
        // B fragments of dims [16 n2, 16 n2 + 8) (vb[0], vb[1]: tokens 0-7, 8-15) and of
        // dims [16 n2 + 8, 16 n2 + 16) (vb[2], vb[3]). V^T: matrices (dims, tokens) read
        // as rows; V: matrices (tokens, dims), transposed by ldmatrix.
        uint32_t vb[4];
        if (flash) {
          tc::ldmatrix_x4_trans(vb, vs + (w0 + (mat & 1) * 8 + mrow) * Lay::kKRow + n2 * 16 +
                                        (mat >> 1) * 8);
        } else {
          tc::ldmatrix_x4(vb, vs + (n2 * 16 + (mat >> 1) * 8 + mrow) * Lay::kVtRow + w0 +
                                  (mat & 1) * 8);
        }
        if (tail) {
          vb[0] = mask_pair(vb[0], tok0 + 2 * t4);
          vb[1] = mask_pair(vb[1], tok0 + 8 + 2 * t4);
          vb[2] = mask_pair(vb[2], tok0 + 2 * t4);
          vb[3] = mask_pair(vb[3], tok0 + 8 + 2 * t4);
        }
        const uint32_t b0[2] = {vb[0], vb[1]};
        const uint32_t b1[2] = {vb[2], vb[3]};
        tc::mma_m16n8k16<T>(o[2 * n2], pa, b0, o[2 * n2]);
        tc::mma_m16n8k16<T>(o[2 * n2 + 1], pa, b1, o[2 * n2 + 1]);
      }
    }
    __syncthreads();  // buffer s & 1 (fp8: the 16-bit tiles) is refilled next
  }

  // ---- merge the warps' states.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (t4 == 0) {
    m_w[warp][g] = m_run[0];
    m_w[warp][g + 8] = m_run[1];
    l_w[warp][g] = l_run[0];
    l_w[warp][g + 8] = l_run[1];
  }
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem_raw);  // [warps][16][HEAD]
  {
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      float M = -INFINITY;
      for (int w = 0; w < Lay::kWarps; ++w) M = fmaxf(M, m_w[w][row]);
      f[r] = m_run[r] == -INFINITY ? 0.f : __expf(m_run[r] - M);
    }
    float* rw = red + warp * 16 * HEAD;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      const int d = n * 8 + 2 * t4;
      rw[g * HEAD + d] = o[n][0] * f[0];
      rw[g * HEAD + d + 1] = o[n][1] * f[0];
      rw[(g + 8) * HEAD + d] = o[n][2] * f[1];
      rw[(g + 8) * HEAD + d + 1] = o[n][3] * f[1];
    }
  }
  __syncthreads();
  for (int i = tid; i < G * HEAD; i += NT) {
    const int row = i / HEAD;
    const int d = i - row * HEAD;
    float M = -INFINITY;
    for (int w = 0; w < Lay::kWarps; ++w) M = fmaxf(M, m_w[w][row]);
    float Lsum = 0.f, acc = 0.f;
    for (int w = 0; w < Lay::kWarps; ++w) {
      if (m_w[w][row] != -INFINITY) Lsum += l_w[w][row] * __expf(m_w[w][row] - M);
      acc += red[(w * 16 + row) * HEAD + d];
    }
    const float inv = Lsum > 0.f ? p.v_scale / Lsum : 0.f;
    const int64_t orow = static_cast<int64_t>(seq) * p.num_heads + head0 + row;
    T* out = static_cast<T*>(p.out) + (is_v2 ? (orow * p.num_partitions + part) * HEAD : orow * HEAD);
    out[d] = from_float<T>(acc * inv);
    if (is_v2 && d == 0) {
      const int64_t idx = orow * p.num_partitions + part;
      p.max_logits[idx] = M;
      p.exp_sums[idx] = Lsum;
    }
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
