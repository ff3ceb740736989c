// CUDA varlen paged attention (prefill over the paged cache): a flash-style tiled kernel.
//
// Layouts (vLLM v0.6, as attention_kernels.cuh; see csrc/ops.h):
//   query        [num_tokens, num_heads, head_size] flat over sequences, strides
//                q_stride_token / q_stride_head, last dim contiguous (read element-wise)
//   out          [num_tokens, num_heads, head_size] (contiguous), the query dtype
//   key_cache    [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 B / elem
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//                or both in the flash layout [num_blocks, block_size, num_kv_heads,
//                head_size] (p.flash_layout): V tiles are then read as K tiles are, a
//                token's 16-byte chunks from its row.
//                Elements: the query dtype ("auto") or fp8 bytes (uint8, "fp8" =
//                "fp8_e4m3" / "fp8_e5m2", x = 16), decoded exactly (cuda/dtype.cuh).
//   block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]
//   query_start_loc int32 [num_seqs + 1]: sequence s's query rows are
//                qsl[s] .. qsl[s + 1]
// Semantics: sequence s with n query rows and context length L: query j sits at position
//   L - n + j and attends to positions 0 .. L - n + j (bottom-right causal).
//   logit = scale * k_scale * q.k (+ slope[h] * (t - qpos) with ALiBi); out = softmax @ V *
//   v_scale (0 for a row that sees no position).
//
// varlen_paged_attention_kernel<T, CT, HEAD_MAX> (T: query / output dtype, CT: cache
// element), HEAD_MAX in {64, 128, 256}: the head-size
// bucket (as the decode kernel's) that fixes the tile sizes and register arrays; loops are
// guarded by the runtime head_size (any multiple of 8 up to kMaxHeadSize; of 16 for fp8).
//   Rows   a CTA owns R = kVarlenTileFloats / HEAD_MAX query rows (64 / 32 / 16): row r is
//          (query token j0 + r / heads_per_cta, query head head0 + r % heads_per_cta) of
//          ONE kv head, so each K/V tile is loaded once for all the heads of a GQA / MQA
//          group. A group larger than R is split over head_chunks CTAs (balanced);
//          query_tile = R / heads_per_cta tokens per CTA. Warp w owns rows w*R/4 .. +R/4.
//   Grid   x = query_tiles * num_seqs * num_kv_heads * head_chunks, 1-D, ordered
//          (query tile k, sequence, kv head, head chunk) with k slowest. It is built on
//          the device from query_start_loc, with no host copy (CUDA-graph safe):
//          query_tiles = ceil(max_query_len / query_tile) bounds every sequence, and tile
//          k of a sequence covers its queries [n - (k + 1) * query_tile, n - k * query_tile)
//          counted FROM THE END (the first tile of a sequence may be partial). CTAs with
//          k * query_tile >= n exit at once. So tile 0 of every sequence, the one that sees
//          the most context, is launched first. Cost: ragged batches launch idle CTAs
//          (a decode row next to a long prompt gets query_tiles - 1 of them).
//   Block  kThreads = 128 threads (4 warps).
//   Work   the CTA's visible context [0, ctx_end) (ctx_end = position of its last query
//          + 1) is walked in KV tiles of TT = min(32, kVarlenTileFloats / HEAD_MAX) tokens
//          (32 / 32 / 16) with an online softmax, float32 throughout:
//     1. K tile -> kv_s (float32, [TT][HS + 4]): one 16-byte key chunk per thread step,
//        consecutive threads on consecutive tokens. Tokens past ctx_end and blocks whose id
//        is outside [0, num_blocks) read as zeros (a corrupt table can never fault).
//     2. QK, per warp: lane <-> token (TGS = 32 / TT lanes per token, xor-shuffle reduced);
//        each lane dots its key with the warp's R/4 query rows (q_s, broadcast float4s);
//        logit * scale * k_scale -> p_s [R][TT + 4]; __syncwarp.
//     3. softmax, per warp: LPR = 32 / (R/4) lanes per row, each over every LPR-th token of
//        the tile: ALiBi, causal limit by index (token < min(qpos + 1 - c0, count)), tile
//        max, running max m, p = exp(logit - m) in place (masked: 0), running sum l, rescale
//        alpha -> alpha_s. m, l live in the row's lanes' registers.
//     4. V tile -> kv_s (overwriting K; float32, [TT][HS + 4], token-major): one 16-byte
//        chunk (x consecutive tokens of one row of a block; fp8: 8 bytes, 8 tokens, since
//        a row of a block of 8 is 8 bytes) per thread step; tokens past ctx_end are zeros
//        (their slots may hold anything, and NaN * 0 = NaN).
//     5. PV, per warp: lane <-> dims lane + 32 i (HEAD_MAX / 32 of them); acc[R/4][.] =
//        acc * alpha + sum_t p[row][t] * v[t][d], 4 tokens per step (float4 of p_s).
//     Four __syncthreads per tile (K ready, K consumed, V ready, V consumed): K and V share
//     one buffer so that R x HEAD_MAX and TT x HEAD_MAX can both be 4096 floats.
//   Output out = acc * v_scale / l (0 when l == 0), rounded to T, from the PV lanes.
//   Shared memory: dynamic, varlen_smem_floats(HEAD_MAX, head_size) floats:
//          q_s R*HS | kv_s TT*(HS+4) | p_s R*(TT+4) | alpha_s R | l_s R; at most 37.3 KiB
//          (head_size 128), under the 48 KiB default (static_assert below): no opt-in.
//          Nothing grows with the sequence or query length.
//   dtypes: float, half, bfloat16; caches in the query dtype or fp8 e4m3 / e5m2. Block
//          sizes: 8, 16, 32 (the launcher checks; the kernel only needs block_size to be a
//          multiple of the V load unit, 4 or 8 tokens). Limits shared with the CPU side: csrc/attention_limits.h.
//   Bounds: query_start_loc entries are clamped to [0, num_tokens] (and qsl[s + 1] to >=
//          qsl[s]), seq_lens to [0, max_tokens = max_blocks_per_seq * block_size], so the
//          query, out and the block table are never indexed outside, even when values were
//          not validated (VLLM_LITE_CHECK_VALUES unset, CUDA graph capture). A sequence with
//          more queries than query_tiles * query_tile leaves its first rows unwritten; one
//          with more queries than context gives the rows before position 0 zeros.
//   Not done yet (simple first): QK and PV are float32 FMAs on the SIMT cores (no tensor
//          cores), the next tile's K/V loads do not overlap this tile's math (no cp.async
//          double buffering), and tiles above a warp's causal limit are still computed
//          (masked by index).
#pragma once

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "../../attention_limits.h"
#include "../dtype.cuh"
#include "attention_kernels.cuh"  // kThreads, kWarps

namespace vllm_lite {
namespace cuda {
namespace varlen {

using attn::kThreads;
using attn::kWarps;

// Floats of the query tile (rows x HEAD_MAX) and, at most, of the KV tile (tokens x
// HEAD_MAX): rows and tile tokens per head-size bucket follow from it.
constexpr int kVarlenTileFloats = 16 * kMaxHeadSize;
// At most one KV tile token per lane in the QK pass.
constexpr int kVarlenMaxTileTokens = 32;
// Floats appended to each kv_s / p_s row: keeps float4 alignment and puts the rows of
// consecutive lanes in different banks.
constexpr int kVarlenPad = 4;

// Head-size bucket (the kernel's HEAD_MAX) of a runtime head size.
__host__ __device__ constexpr int varlen_head_bucket(int head_size) {
  return head_size <= 64 ? 64 : (head_size <= 128 ? 128 : kMaxHeadSize);
}
// Query rows per CTA.
__host__ __device__ constexpr int varlen_rows(int head_max) {
  return kVarlenTileFloats / head_max;
}
// Tokens per KV tile.
__host__ __device__ constexpr int varlen_tile_tokens(int head_max) {
  return kVarlenTileFloats / head_max < kVarlenMaxTileTokens ? kVarlenTileFloats / head_max
                                                             : kVarlenMaxTileTokens;
}
// Dynamic shared memory in floats (layout in the header comment).
__host__ __device__ constexpr int varlen_smem_floats(int head_max, int head_size) {
  return varlen_rows(head_max) * head_size +
         varlen_tile_tokens(head_max) * (head_size + kVarlenPad) +
         varlen_rows(head_max) * (varlen_tile_tokens(head_max) + kVarlenPad) +
         2 * varlen_rows(head_max);
}

static_assert(kMaxHeadSize == 256, "the largest head-size bucket is 256");
static_assert(varlen_smem_floats(64, 64) * sizeof(float) <= 48 * 1024 &&
                  varlen_smem_floats(128, 128) * sizeof(float) <= 48 * 1024 &&
                  varlen_smem_floats(256, 256) * sizeof(float) <= 48 * 1024,
              "the varlen kernel's dynamic shared memory must fit the 48 KiB default");

struct VarlenParams {
  void* out;  // [num_tokens, H, D]
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* alibi_slopes;  // [H] or nullptr
  int64_t q_stride_token;     // elements
  int64_t q_stride_head;
  int64_t kv_block_stride;  // elements between blocks: num_kv_heads * head_size * block_size
  bool flash_layout;        // the caches' layout (PagedAttentionDims::flash_layout)
  int64_t kv_token_stride;  // flash layout: elements between a block's tokens
  int64_t num_blocks;
  int64_t num_tokens;  // query_start_loc entries are clamped to [0, num_tokens]
  int max_tokens;      // sequence lengths are clamped to [0, max_tokens]
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int group_size;     // num_heads / num_kv_heads
  int heads_per_cta;  // <= R
  int head_chunks;    // ceil(group_size / heads_per_cta)
  int query_tile;     // R / heads_per_cta query tokens per CTA
  int max_blocks_per_seq;
  float qk_scale;  // scale * k_scale
  float v_scale;
};

template <typename T, typename CT, int HEAD_MAX>
__global__ void __launch_bounds__(kThreads) varlen_paged_attention_kernel(const VarlenParams p) {
  constexpr int R = varlen_rows(HEAD_MAX);         // query rows of the CTA
  constexpr int TT = varlen_tile_tokens(HEAD_MAX);  // tokens of a KV tile
  constexpr int RW = R / kWarps;                    // rows per warp
  constexpr int TGS = 32 / TT;                      // lanes per token (QK)
  constexpr int LPR = 32 / RW;                      // lanes per row (softmax)
  constexpr int DPL = HEAD_MAX / 32;                // output dims per lane (PV)
  constexpr int PS = TT + kVarlenPad;               // p_s row stride
  constexpr int X = kChunkElems<CT>;  // key chunk (the cache layout's x)
  // V loads: VX consecutive tokens of one value row, 16 bytes, or 8 bytes for fp8 (at most
  // 8 tokens, so a unit never crosses a block of the smallest size, 8).
  constexpr int VX = X < 8 ? X : 8;
  static_assert(HEAD_MAX == 64 || HEAD_MAX == 128 || HEAD_MAX == 256, "head bucket");
  static_assert(RW * kWarps == R && RW * LPR == 32 && TT * TGS == 32, "lane mappings");
  static_assert(TT % 4 == 0 && TT % VX == 0 && DPL * 32 == HEAD_MAX, "tile shapes");

  extern __shared__ __align__(16) float varlen_smem[];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // ---- CTA -> (query tile k from the end, sequence, kv head, head chunk)
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
  const int64_t n = q_end - q_first;                           // the sequence's queries
  const int64_t j_hi = n - static_cast<int64_t>(k) * p.query_tile;  // past the tile's last
  if (j_hi <= 0) return;  // CTA-uniform: before any barrier
  const int64_t j_lo = max(j_hi - p.query_tile, int64_t{0});
  const int nq = static_cast<int>(j_hi - j_lo);  // queries of this tile (<= query_tile)
  const int L = min(max(p.seq_lens[seq], 0), p.max_tokens);
  const int64_t pos_lo = L - n + j_lo;  // position of the tile's first query (< 0: n > L)
  const int ctx_end = static_cast<int>(min(max(L - n + j_hi, int64_t{0}), int64_t{L}));

  const int hpc = p.heads_per_cta;
  const int first = chunk * hpc;
  const int hc = min(hpc, p.group_size - first);  // query heads of this CTA
  const int head0 = kvh * p.group_size + first;   // its first query head
  const int HS = p.head_size;
  const int KS = HS + kVarlenPad;  // kv_s row stride
  const int BS = p.block_size;

  float* q_s = varlen_smem;       // [R][HS]
  float* kv_s = q_s + R * HS;     // [TT][KS]: the K tile, then the V tile
  float* p_s = kv_s + TT * KS;    // [R][PS]: logits, then probabilities
  float* alpha_s = p_s + R * PS;  // [R]
  float* l_s = alpha_s + R;       // [R]

  // ---- queries -> q_s (rows of no query: zeros)
  {
    const T* q = static_cast<const T*>(p.query);
    for (int i = tid; i < R * HS; i += kThreads) {
      const int r = i / HS;
      const int d = i - r * HS;
      const int jr = r / hpc;
      const int h = r - jr * hpc;
      float v = 0.f;
      if (jr < nq && h < hc) {
        v = to_float(q[(q_first + j_lo + jr) * p.q_stride_token +
                       static_cast<int64_t>(head0 + h) * p.q_stride_head + d]);
      }
      q_s[i] = v;
    }
  }

  // ---- this lane's softmax row: position (-1: sees nothing), slope, running stats
  const int sr = warp * RW + lane / LPR;
  const int ss = lane % LPR;
  int qpos = -1;
  float slope = 0.f;
  {
    const int jr = sr / hpc;
    const int h = sr - jr * hpc;
    if (jr < nq && h < hc) {
      qpos = static_cast<int>(max(pos_lo + jr, int64_t{-1}));
      if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[head0 + h];
    }
  }
  float m = -FLT_MAX;
  float l = 0.f;

  float acc[RW][DPL];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[r][i] = 0.f;
  }

  const bool flash = p.flash_layout;
  const int64_t head_offset = static_cast<int64_t>(kvh) * HS * (flash ? 1 : BS);
  const CT* kc = static_cast<const CT*>(p.key_cache) + head_offset;
  const CT* vc = static_cast<const CT*>(p.value_cache) + head_offset;
  // A key's chunk c of token t of a block: t * k_tok + c * k_chunk elements in.
  const int64_t k_tok = flash ? p.kv_token_stride : X;
  const int64_t k_chunk = flash ? X : static_cast<int64_t>(BS) * X;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // Block id of context position pos (< ctx_end <= max_blocks_per_seq * BS), -1 if bad.
  auto block_of = [&](int pos) {
    const int id = table[pos / BS];
    return (id >= 0 && id < p.num_blocks) ? id : -1;
  };

  for (int c0 = 0; c0 < ctx_end; c0 += TT) {
    const int cnt = min(TT, ctx_end - c0);  // context tokens of this tile

    // ---- 1. K tile -> kv_s. A tile of token rows [TT, HS] (token-major), 16-byte chunks
    // of a token at a time: the key cache's, and in the flash layout the value cache's.
    auto load_token_rows = [&](const CT* cache) {
      for (int i = tid; i < TT * (HS / X); i += kThreads) {
        const int t = i % TT;
        const int c = i / TT;
        uint4 raw = zero_chunk();
        if (t < cnt) {
          const int pos = c0 + t;
          const int blk = block_of(pos);
          if (blk >= 0) {
            raw = load_chunk(cache + blk * p.kv_block_stride + c * k_chunk +
                           (pos % BS) * k_tok);
          }
        }
        float f[X];
        chunk_to_float<CT>(raw, f);
        float4* dst = reinterpret_cast<float4*>(kv_s + t * KS + c * X);
#pragma unroll
        for (int e = 0; e < X / 4; ++e) {
          dst[e] = make_float4(f[4 * e], f[4 * e + 1], f[4 * e + 2], f[4 * e + 3]);
        }
      }
    };
    load_token_rows(kc);
    __syncthreads();  // K tile (first tile: q_s too) ready

    // ---- 2. QK: lane <-> token, the warp's RW rows -> p_s
    {
      const int t = lane % TT;
      const int tg = lane / TT;
      float s[RW];
#pragma unroll
      for (int r = 0; r < RW; ++r) s[r] = 0.f;
      const float* kr = kv_s + t * KS;
      for (int d = tg * 4; d < HS; d += 4 * TGS) {
        const float4 kv = *reinterpret_cast<const float4*>(kr + d);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          const float4 qv = *reinterpret_cast<const float4*>(q_s + (warp * RW + r) * HS + d);
          s[r] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
        }
      }
#pragma unroll
      for (int r = 0; r < RW; ++r) {
#pragma unroll
        for (int msk = TT; msk < 32; msk <<= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], msk);
        if (tg == 0) p_s[(warp * RW + r) * PS + t] = s[r] * p.qk_scale;
      }
    }
    __syncwarp();  // the row's logits, from every lane of the warp

    // ---- 3. online softmax: LPR lanes per row
    {
      float* lg = p_s + sr * PS;
      const int nv = min(qpos + 1 - c0, cnt);  // tokens this row sees (<= 0: none)
      auto logit = [&](int t) { return lg[t] + slope * static_cast<float>(c0 + t - qpos); };
      float mx = -FLT_MAX;
      for (int t = ss; t < nv; t += LPR) mx = fmaxf(mx, logit(t));
#pragma unroll
      for (int msk = 1; msk < LPR; msk <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, msk));
      const float m_new = nv > 0 ? fmaxf(m, mx) : m;
      float sum = 0.f;
      for (int t = ss; t < TT; t += LPR) {  // the whole tile: the PV pass reads all of it
        const float e = t < nv ? __expf(logit(t) - m_new) : 0.f;
        lg[t] = e;
        sum += e;
      }
#pragma unroll
      for (int msk = 1; msk < LPR; msk <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, msk);
      const float alpha = nv > 0 ? __expf(m - m_new) : 1.f;  // first tile: exp(-huge) = 0
      l = l * alpha + sum;
      m = m_new;
      if (ss == 0) alpha_s[sr] = alpha;
    }
    __syncthreads();  // every warp is done with the K tile

    // ---- 4. V tile -> kv_s (token-major)
    if (flash) load_token_rows(vc);
    for (int i = tid; i < (flash ? 0 : HS * (TT / VX)); i += kThreads) {
      const int tc = i % (TT / VX);
      const int d = i / (TT / VX);
      const int t0 = tc * VX;
      uint4 raw = zero_chunk();
      if (t0 < cnt) {
        const int pos = c0 + t0;  // VX consecutive tokens of one block (BS % VX == 0)
        const int blk = block_of(pos);
        if (blk >= 0) raw = load_unit<CT, VX>(vc + blk * p.kv_block_stride + d * BS + pos % BS);
      }
      float f[VX];
      unit_to_float<CT, VX>(raw, f);
#pragma unroll
      for (int e = 0; e < VX; ++e) kv_s[(t0 + e) * KS + d] = t0 + e < cnt ? f[e] : 0.f;
    }
    __syncthreads();  // V tile ready

    // ---- 5. PV: lane <-> dims, the warp's RW rows
    {
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const float a = alpha_s[warp * RW + r];
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[r][i] *= a;
      }
      for (int t = 0; t < cnt; t += 4) {  // p and v are 0 past cnt, up to TT
        float v[4][DPL];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            v[e][i] = d < HS ? kv_s[(t + e) * KS + d] : 0.f;
          }
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          const float4 pv = *reinterpret_cast<const float4*>(p_s + (warp * RW + r) * PS + t);
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            acc[r][i] += pv.x * v[0][i] + pv.y * v[1][i] + pv.z * v[2][i] + pv.w * v[3][i];
          }
        }
      }
    }
    __syncthreads();  // kv_s and p_s are rewritten by the next tile
  }

  // ---- output: out = acc * v_scale / l
  if (ss == 0) l_s[sr] = l;
  __syncwarp();
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int row = warp * RW + r;
    const int jr = row / hpc;
    const int h = row - jr * hpc;
    if (jr < nq && h < hc) {
      const float lr = l_s[row];
      const float inv = lr > 0.f ? p.v_scale / lr : 0.f;
      T* o = static_cast<T*>(p.out) +
             ((q_first + j_lo + jr) * p.num_heads + head0 + h) * static_cast<int64_t>(HS);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < HS) o[d] = from_float<T>(acc[r][i] * inv);
      }
    }
  }
}

// ---- Host-side launch planning, shared by the launcher (varlen_attention.cu) and the CPU
// emulation of the kernel (tests/cuda_emulation), so both run the same grids.

using VarlenKernel = void (*)(VarlenParams);

// One instance of varlen_paged_attention_kernel; get() is defined in kernel_instances.cuh
// (see AttentionInstance in attention_kernels.cuh).
template <typename T, typename CT, int HEAD_MAX>
struct VarlenInstance {
  static VarlenKernel get();
};

// One instance of varlen_paged_attention_tc_kernel (varlen_attention_tc_kernels.cuh),
// declared like VarlenInstance; HEAD is the head size (64 or 128).
template <typename T, typename CT, int HEAD>
struct VarlenTcInstance {
  static VarlenKernel get();
};

// The tensor-core kernel's CTA: kVarlenTcWarps warps of 16 query rows each (one MMA tile
// of M rows per warp).
constexpr int kVarlenTcWarps = 4;
constexpr int kVarlenTcThreads = 32 * kVarlenTcWarps;
constexpr int kVarlenTcRows = 16 * kVarlenTcWarps;

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite

#include <c10/util/Exception.h>  // TORCH_CHECK in the kernel lookups below

#include "attention_path.h"
#include "kernel_build_config.h"      // generated: the build options
#include "varlen_attention_table.h"  // generated: varlen_attention_table<T, CT>
#include "varlen_attention_tc_table.h"  // generated: varlen_attention_tc_table<T, CT>

namespace vllm_lite {
namespace cuda {
namespace varlen {

// The instantiation that serves head_size with cache element CT (T, or fp8_e4m3 /
// fp8_e5m2); launched with <<<grid_x, kThreads, varlen_smem_floats(bucket, head_size) * 4>>>.
template <typename T, typename CT>
VarlenKernel varlen_kernel_for(int head_size) {
  const VarlenKernel kernel = varlen_attention_table<T, CT>(varlen_head_bucket(head_size));
  TORCH_CHECK(kernel != nullptr,
              "varlen_paged_attention: this build has no CUDA kernel for head_size ", head_size,
              " with kv_cache_dtype ", cache_dtype_name<T, CT>(), ": it was built with ",
              kKernelBuildSettings,
              "; rebuild with them unset (every kernel) or including this case");
  return kernel;
}

struct VarlenPlan {
  int64_t heads_per_cta;
  int64_t head_chunks;
  int64_t query_tile;
  int64_t query_tiles;
  int64_t grid_x;  // may exceed INT_MAX: the launcher refuses that
  size_t smem_bytes;
};

// How the rows of a CTA are split between query heads and tokens (see the grid above):
// `rows` query rows per CTA (the SIMT kernel's varlen_rows, the tensor-core kernel's
// kVarlenTcRows), `smem_bytes` of dynamic shared memory.
inline VarlenPlan plan_varlen_rows(int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                                   int64_t max_query_len, int64_t rows, size_t smem_bytes) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  VarlenPlan pl{};
  pl.head_chunks = cdiv(group, rows);
  pl.heads_per_cta = cdiv(group, pl.head_chunks);
  pl.query_tile = rows / pl.heads_per_cta;
  pl.query_tiles = cdiv(max_query_len, pl.query_tile);
  const int64_t per_tile = num_seqs * num_kv_heads * pl.head_chunks;
  // Saturates instead of overflowing int64 for absurd max_query_len values.
  pl.grid_x = pl.query_tiles > INT64_MAX / (per_tile > 0 ? per_tile : 1)
                  ? INT64_MAX
                  : pl.query_tiles * per_tile;
  pl.smem_bytes = smem_bytes;
  return pl;
}

// The SIMT kernel's plan.
inline VarlenPlan plan_varlen(int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                              int64_t head_size, int64_t max_query_len) {
  const int bucket = varlen_head_bucket(static_cast<int>(head_size));
  return plan_varlen_rows(
      num_seqs, num_kv_heads, group, max_query_len, varlen_rows(bucket),
      static_cast<size_t>(varlen_smem_floats(bucket, static_cast<int>(head_size))) * sizeof(float));
}

// How a varlen launch runs (the launcher and the emulator's replay of it use this).
struct VarlenLaunch {
  attn::VarlenPath path;
  VarlenKernel kernel;
  VarlenPlan plan;
  int threads;
};

// The kernel, grid plan and block of one varlen_paged_attention launch for query dtype T
// and cache element CT on a device of compute capability `cc`: varlen_path
// (attention_path.h) chooses the kernel; a tensor-core choice this build has no instance
// for falls back to the SIMT kernel.
template <typename T, typename CT>
VarlenLaunch plan_varlen_launch(int cc, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                                int64_t head_size, int64_t max_query_len) {
  constexpr bool k16 = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;
  if (attn::varlen_path(cc, k16, std::is_same_v<CT, T>, head_size) ==
      attn::VarlenPath::kTensorCore) {
    const VarlenKernel kernel = varlen_attention_tc_table<T, CT>(static_cast<int>(head_size));
    if (kernel != nullptr) {
      // The tensor-core kernel's shared memory is static (under the 48 KiB limit).
      return {attn::VarlenPath::kTensorCore, kernel,
              plan_varlen_rows(num_seqs, num_kv_heads, group, max_query_len, kVarlenTcRows, 0),
              kVarlenTcThreads};
    }
  }
  return {attn::VarlenPath::kSimt, varlen_kernel_for<T, CT>(static_cast<int>(head_size)),
          plan_varlen(num_seqs, num_kv_heads, group, head_size, max_query_len), kThreads};
}

// The kernel's parameters from the (validated) dimensions, the plan and the pointers.
inline VarlenParams make_varlen_params(
    const VarlenPlan& pl, int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
    int64_t max_blocks_per_seq, int64_t q_stride_token, int64_t q_stride_head, double scale,
    double k_scale, double v_scale, void* out, const void* query, const void* key_cache,
    const void* value_cache, const int32_t* block_tables, const int32_t* seq_lens,
    const int32_t* query_start_loc, const float* alibi_slopes, bool flash_layout) {
  VarlenParams p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.alibi_slopes = alibi_slopes;
  p.q_stride_token = q_stride_token;
  p.q_stride_head = q_stride_head;
  p.kv_block_stride = num_kv_heads * head_size * block_size;
  p.flash_layout = flash_layout;
  p.kv_token_stride = num_kv_heads * head_size;
  p.num_blocks = num_blocks;
  p.num_tokens = num_tokens;
  const int64_t max_tokens = max_blocks_per_seq * block_size;
  const int64_t cap = INT32_MAX - kVarlenMaxTileTokens;  // c0 + TT never overflows
  p.max_tokens = static_cast<int>(max_tokens < cap ? max_tokens : cap);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(block_size);
  p.group_size = static_cast<int>(num_heads / num_kv_heads);
  p.heads_per_cta = static_cast<int>(pl.heads_per_cta);
  p.head_chunks = static_cast<int>(pl.head_chunks);
  p.query_tile = static_cast<int>(pl.query_tile);
  p.max_blocks_per_seq = static_cast<int>(max_blocks_per_seq);
  p.qk_scale = static_cast<float>(scale * k_scale);
  p.v_scale = static_cast<float>(v_scale);
  return p;
}

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
