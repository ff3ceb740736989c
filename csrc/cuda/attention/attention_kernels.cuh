// CUDA paged-attention kernels (decode: one query token per sequence).
//
// Layouts (vLLM v0.6, see csrc/ops.h):
//   query        [num_seqs, num_heads, head_size], strides q_stride_seq / q_stride_head,
//                last dim contiguous (read element-wise, any alignment)
//   key_cache    [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 B / elem
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//                or both in the flash layout [num_blocks, block_size, num_kv_heads,
//                head_size] (p.flash_layout): the K pass reads a token's 16-byte chunks
//                from its row, the V pass gathers a unit's VX tokens of one dim element
//                by element (load_unit_strided); the rest is the same.
//                Elements: the query dtype (kv_cache_dtype "auto") or fp8 bytes (uint8,
//                "fp8" = "fp8_e4m3" / "fp8_e5m2", x = 16, head_size % 16 == 0), decoded
//                exactly (cuda/dtype.cuh); k_scale / v_scale are folded into qk_scale and the
//                output scale, so the kernel reads cache * scale as the CPU kernels do.
//   block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]
//   out          [num_seqs, num_heads, head_size] (contiguous)
//   v2 scratch   exp_sums / max_logits float32 [num_seqs, num_heads, P],
//                tmp_out [num_seqs, num_heads, P, head_size] in the query dtype
//
// paged_attention_kernel<T, CT, BLOCK_SIZE, HEAD_MAX> serves v1 and v2 (T: query / output
// dtype, CT: cache element).
//   Grid   x = num_seqs * num_kv_heads * ctas_per_kv_head, y = partitions (v1: 1).
//          A CTA serves up to kMaxHeadsPerCta (8) query heads of ONE kv head (GQA/MQA: each
//          K/V block is read once for all of them); a group of g query heads is split over
//          ceil(g / heads_per_cta) CTAs (64:1 GQA -> 8 CTAs per kv head). The launcher
//          lowers heads_per_cta when that would leave the GPU with too few CTAs.
//   Block  kThreads = 128 threads (4 warps).
//   Work   the CTA's token range (v1: the whole sequence; v2: one 512-token partition) is
//          walked in chunks of kChunkTokens = 512 tokens with an online softmax:
//     1. block numbers of the chunk -> shared memory (ids outside [0, num_blocks) -> -1:
//        that block reads as zeros, so a corrupt table can never fault).
//     2. K pass: TGS lanes share a token, a warp step covers 32 / TGS tokens; each lane
//        holds KCPL chunks (16 bytes) of its key, dc = tg + k * TGS (lane-interleaved, so
//        a warp's loads of one step are contiguous 16-byte chunks). Several heads (G > 1):
//        KCPL <= 8 chunks and <= 64 key values per lane, converted to float32 once; per
//        head a dot with q read from shared memory. One head (G == 1: MHA, or the last
//        CTA of a split group; a CTA-uniform branch to a loop compiled apart from the
//        multi-head one, so it adds no registers to it): the q values matching the lane's
//        chunks are read from shared memory into registers once per chunk of tokens (<= 32
//        floats: KCPL1 = min(KCPL, 32 / elements per chunk) chunks per lane and TGS1 lanes
//        per token there), and the dot product reads no shared memory. Then an xor-shuffle
//        reduce over the lanes of the token, logit -> shared memory.
//     3. softmax: one warp per head: chunk max, new running max m, p = exp(logit - m)
//        written back in place, running sum l = l * exp(m_old - m) + sum(p).
//     4. V pass: a block's value tile [head_size, block_size] is contiguous; it is read in
//        units of VX = min(16 bytes, one row) elements (8-byte units for the 8-byte rows of
//        fp8 at block size 8), UPR = block_size / VX units per row. Rows are taken in
//        "row groups" of 32; row group rg of a block is read by one warp with UPR load
//        instructions, instruction k: lane = r * UPR + c loads unit c of row
//        rg * 32 + k * (32 / UPR) + r, so each instruction reads 32 consecutive units
//        (coalesced). The ceil(head_size / 32) row groups are spread over the 4 warps
//        (up to 2 per warp at head_size 256); with fewer row groups than warps (head_size
//        <= 96), kWarps / row groups "splits" of warps take alternate blocks and are
//        summed through shared memory at the end. A lane's unit covers the same VX tokens
//        in all UPR instructions: per block and head it forms UPR partial dots
//        p[tokens] . v[row k][tokens], and a reduce-scatter over the UPR lanes of the rows
//        (UPR - 1 xor shuffles per head) leaves lane c with the block's full sum for row
//        k = c, i.e. row rg * 32 + c * (32 / UPR) + r, which it accumulates in registers:
//        acc[row][head] = acc * exp(m_old - m) + sum_t p[t] * v[t]. U <= 8 blocks are in
//        flight per step; token slots past the sequence's end are zeroed before use.
//   Output v1: out = acc * v_scale / l (0 when the sequence is empty).
//          v2: tmp_out = acc * v_scale / l, max_logits = m, exp_sums = l, per partition;
//              partitions at or past a sequence's end exit at once (write nothing).
//   Shared memory: dynamic heads_per_cta * (head_size + 512) * 4 B (q and logits; at most
//          8 * (256 + 512) * 4 = 24 KiB, under the 48 KiB default: no opt-in needed), plus
//          static 512 / block_size ints and 3 * 8 floats. It does NOT grow with the sequence
//          length: long sequences only add chunks, so v1 has no length limit.
//   Head sizes: every multiple of 8 (fp8: 16) up to kMaxHeadSize = 256, at runtime; HEAD_MAX in
//          {64, 128, 256} is a bucket that fixes register arrays (key chunks per lane, value
//          row groups per warp) and the loops are guarded by the runtime head_size.
//   Limits shared with the CPU side and validate.cpp: csrc/attention_limits.h.
//   Block sizes: 8, 16, 32 (template). dtypes: float, half, bfloat16 (math in float32);
//          caches in the query dtype or fp8 e4m3 / e5m2.
//   Bounds: seq_len is clamped to [0, max_tokens] (max_tokens <= max_blocks_per_seq *
//          block_size, and <= P * 512 for v2), so the table is never indexed past its row
//          and partitions stay inside the scratch, even when values were not validated
//          (VLLM_LITE_CHECK_VALUES unset, or CUDA graph capture).
//
// paged_attention_v2_reduce_kernel<T>: grid x = num_seqs * num_heads, 128 threads. Combines
//   the partitions: M = max_p max_logits, w_p = exp_sums_p * exp(max_logits_p - M),
//   out = sum_p w_p tmp_out_p / sum_p w_p (a single partition is copied as is, an empty
//   sequence writes zeros). Weights are staged in shared memory 256 partitions at a time,
//   so any number of partitions works with 1 KiB of shared memory.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "../../attention_limits.h"
#include "../dtype.cuh"
#include "../warp.cuh"

namespace vllm_lite {
namespace cuda {
namespace attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunkTokens = kPartitionSize;  // softmax chunk of the online loop == v2 partition
constexpr int kMaxHeadsPerCta = 8;
// Dynamic shared memory (attention_smem_bytes) at the limits: no opt-in above 48 KiB needed.
static_assert(kMaxHeadsPerCta * (kMaxHeadSize + kChunkTokens) * sizeof(float) <= 48 * 1024,
              "the attention kernel's dynamic shared memory must fit the 48 KiB default");

struct AttentionParams {
  void* out;          // v1: out [S, H, D]; v2: tmp_out [S, H, P, D]
  float* exp_sums;    // v2: [S, H, P]; v1: nullptr (selects the v1 output)
  float* max_logits;  // v2: [S, H, P]; v1: nullptr
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // [H] or nullptr
  int64_t q_stride_seq;       // elements
  int64_t q_stride_head;
  int64_t kv_block_stride;  // elements between blocks: num_kv_heads * head_size * block_size
  bool flash_layout;        // the caches' layout (PagedAttentionDims::flash_layout)
  int64_t kv_token_stride;  // flash layout: elements between a block's tokens
  int64_t num_blocks;
  int64_t max_tokens;  // sequence lengths are clamped to [0, max_tokens]
  int num_heads;
  int num_kv_heads;
  int head_size;
  int group_size;        // num_heads / num_kv_heads
  int heads_per_cta;     // <= kMaxHeadsPerCta
  int ctas_per_kv_head;  // ceil(group_size / heads_per_cta)
  int max_blocks_per_seq;
  int num_partitions;    // P of the v2 scratch (1 for v1)
  int partition_tokens;  // v2: kChunkTokens; v1: INT_MAX (one range per sequence)
  float qk_scale;        // scale * k_scale
  float v_scale;
};

struct ReduceParams {
  void* out;  // [S, H, D]
  const float* exp_sums;
  const float* max_logits;
  const void* tmp_out;
  const int32_t* seq_lens;
  int64_t max_tokens;  // same clamp as the attention kernel
  int num_heads;
  int head_size;
  int num_partitions;
};

// Block-wide reductions for kThreads threads; `red` holds kWarps floats. Every thread
// must call them; they return the result to all threads.
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) r = fmaxf(r, red[i]);
  __syncthreads();  // red may be reused right after
  return r;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) r += red[i];
  __syncthreads();
  return r;
}

// Reduce-scatter over the N lanes lane ^ m (m < N, N a power of two <= 32) of a group:
// every lane passes N partial sums x[0..N); lane returns sum over the group of
// x[lane % N]. Recursive halving: N - 1 shuffles (not N * log2(N) as N all-reduces would
// take). x is clobbered. All 32 lanes must call it.
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&x)[N], int lane) {
#pragma unroll
  for (int s = 0; (1 << s) < N; ++s) {
    // Before this step x[i] (i < 2n) is the sum over the lanes differing in bits < s of
    // the partial whose index has bits < s equal to this lane's and bits >= s equal to i.
    const int m = 1 << s;
    const int n = N >> (s + 1);
    const bool hi = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const float keep = hi ? x[2 * i + 1] : x[2 * i];
      const float send = hi ? x[2 * i] : x[2 * i + 1];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
  }
  return x[0];
}

// Dynamic shared memory of the attention kernel, in bytes.
inline size_t attention_smem_bytes(int heads_per_cta, int head_size) {
  return static_cast<size_t>(heads_per_cta) * (head_size + kChunkTokens) * sizeof(float);
}

template <typename T, typename CT, int BLOCK_SIZE, int HEAD_MAX>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const AttentionParams p) {
  constexpr int BS = BLOCK_SIZE;
  constexpr int X = kChunkElems<CT>;                      // cache elements per 16-byte chunk
  constexpr int kTokenChunks = HEAD_MAX / X;              // chunks of one key (bucket max)
  // Key chunks per lane: at most 8, and at most 64 floats of key per lane once converted
  // (fp8: 4 chunks of 16), which bounds the registers of kf below.
  constexpr int kMaxKcpl = 64 / X < 8 ? 64 / X : 8;
  constexpr int KCPL = kTokenChunks < kMaxKcpl ? kTokenChunks : kMaxKcpl;
  constexpr int TGS = kTokenChunks / KCPL;                // lanes per token
  // One query head (G == 1): q of the lane's chunks stays in registers, at most 32 floats
  // of it: 64 (KCPL chunks of half / bf16 / fp8) made ptxas spill, as -Xptxas -v shows.
  constexpr int KCPL1 = KCPL * X > 32 ? 32 / X : KCPL;
  constexpr int TGS1 = kTokenChunks / KCPL1;
  // V pass. A value row of a block is BS elements, read in units of VX elements: 16 bytes,
  // or 8 bytes when the row is shorter than a chunk (fp8 at block size 8). A warp load
  // instruction covers 32 consecutive units of a block's value tile [head_size, BS], i.e.
  // RPI whole rows with UPR lanes per row; a row group is the 32 rows that UPR such
  // instructions cover.
  constexpr int VX = X < BS ? X : BS;
  constexpr int UPR = BS / VX;                            // units (lanes) per row
  constexpr int RPI = 32 / UPR;                           // rows per warp load instruction
  constexpr int kGroupRows = 32;
  // Row groups per warp (the bucket's head over kWarps warps).
  constexpr int RGW = (HEAD_MAX + kWarps * kGroupRows - 1) / (kWarps * kGroupRows);
  // Bytes a lane loads per block: one row's worth (UPR units) per row group.
  constexpr int kRowBytes = RGW * BS * static_cast<int>(sizeof(CT));
  constexpr int U = kRowBytes >= 128 ? 1 : (128 / kRowBytes < 8 ? 128 / kRowBytes : 8);
  constexpr int kBlocksPerChunk = kChunkTokens / BS;
  static_assert(BS == 8 || BS == 16 || BS == 32, "block size");
  static_assert(HEAD_MAX % (KCPL * X) == 0, "head bucket");
  static_assert(TGS * KCPL == kTokenChunks && TGS >= 1 && TGS <= 32 && 32 % TGS == 0,
                "lanes per token");
  static_assert(TGS1 * KCPL1 == kTokenChunks && TGS1 >= 1 && TGS1 <= 32 && 32 % TGS1 == 0,
                "lanes per token (one head)");
  static_assert(UPR >= 1 && UPR * VX == BS && UPR <= 32 && 32 % UPR == 0,
                "value rows are whole load units, a power of two of them");
  static_assert(RGW * kWarps * kGroupRows >= HEAD_MAX, "every value row has a lane");
  static_assert(BS % 4 == 0 && kChunkTokens % BS == 0, "float4 reads of probabilities");

  extern __shared__ __align__(16) float smem[];
  __shared__ int blk_s[kBlocksPerChunk];
  __shared__ float m_s[kMaxHeadsPerCta];      // running max per head
  __shared__ float l_s[kMaxHeadsPerCta];      // running sum of exp per head
  __shared__ float alpha_s[kMaxHeadsPerCta];  // rescale of acc for the current chunk

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  const int ctas_per_seq = p.num_kv_heads * p.ctas_per_kv_head;
  const int seq = blockIdx.x / ctas_per_seq;
  const int rem = blockIdx.x - seq * ctas_per_seq;
  const int kvh = rem / p.ctas_per_kv_head;
  const int first = (rem - kvh * p.ctas_per_kv_head) * p.heads_per_cta;
  const int G = min(p.heads_per_cta, p.group_size - first);  // query heads of this CTA
  const int head0 = kvh * p.group_size + first;               // its first query head
  const int part = blockIdx.y;
  const int HS = p.head_size;
  const bool is_v2 = p.exp_sums != nullptr;

  const int L = static_cast<int>(
      min(static_cast<int64_t>(max(p.seq_lens[seq], 0)), p.max_tokens));
  const int start = part * p.partition_tokens;  // v1: part == 0
  if (is_v2 && start >= L) return;              // CTA-uniform: before any barrier
  const int end = static_cast<int>(
      min(static_cast<int64_t>(L), static_cast<int64_t>(start) + p.partition_tokens));

  float* q_s = smem;                              // [G][HS]
  float* logit_s = smem + p.heads_per_cta * HS;   // [G][kChunkTokens]

  {
    const T* q = static_cast<const T*>(p.query) + seq * p.q_stride_seq +
                 static_cast<int64_t>(head0) * p.q_stride_head;
    for (int i = tid; i < G * HS; i += kThreads) {
      const int h = i / HS;
      const int d = i - h * HS;
      q_s[i] = to_float(q[h * p.q_stride_head + d]);
    }
  }
  if (tid < kMaxHeadsPerCta) {
    m_s[tid] = -FLT_MAX;
    l_s[tid] = 0.f;
    alpha_s[tid] = 1.f;
  }

  // V-pass mapping. The head's nrg row groups are spread over wrg warps (warp rg0 takes
  // row groups rg0, rg0 + wrg, ...); when there are fewer row groups than warps, the
  // kWarps / wrg "splits" of warps take alternate blocks and are summed at the end.
  // Within a row group, lane = vrow * UPR + vunit loads unit vunit of row k * RPI + vrow in
  // load instruction k < UPR: consecutive lanes, consecutive units. After the per-block
  // reduction over the UPR lanes of a row (reduce_scatter), the lane holds row
  // vunit * RPI + vrow of the row group: acc[j][h] for row group rg0 + j * wrg.
  const int nrg = (HS + kGroupRows - 1) / kGroupRows;
  const int wrg = min(nrg, kWarps);
  const int splits = kWarps / wrg;
  const int split = warp / wrg;  // warp-uniform
  const int rg0 = warp - split * wrg;
  const bool v_active = split < splits;
  const int vunit = lane % UPR;
  const int vrow = lane / UPR;
  const int vown = vunit * RPI + vrow;  // the row of a row group this lane accumulates

  float acc[RGW][kMaxHeadsPerCta];
#pragma unroll
  for (int j = 0; j < RGW; ++j) {
#pragma unroll
    for (int h = 0; h < kMaxHeadsPerCta; ++h) acc[j][h] = 0.f;
  }

  const bool flash = p.flash_layout;
  const int64_t ts = p.kv_token_stride;
  const int64_t head_offset = static_cast<int64_t>(kvh) * HS * (flash ? 1 : BS);
  const CT* kc = static_cast<const CT*>(p.key_cache) + head_offset;
  const CT* vc = static_cast<const CT*>(p.value_cache) + head_offset;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // A key's chunk dc of token t of a block: t * k_tok + dc * k_chunk elements in.
  const int64_t k_tok = flash ? ts : X;
  const int64_t k_chunk = flash ? X : BS * X;

  for (int c0 = start; c0 < end; c0 += kChunkTokens) {
    const int n = min(kChunkTokens, end - c0);  // tokens of this chunk
    const int nb = (n + BS - 1) / BS;           // blocks of this chunk
    // c0 is a multiple of 512, hence of BS; c0 / BS + i <= (end - 1) / BS < max_blocks.
    for (int i = tid; i < nb; i += kThreads) {
      const int id = table[c0 / BS + i];
      blk_s[i] = (id >= 0 && id < p.num_blocks) ? id : -1;
    }
    __syncthreads();  // blk_s ready (first chunk: q_s and the running stats too)

    // ---- K pass: logits of the chunk for all G heads -> logit_s.
    {
      const int nck = HS / X;  // chunks of one key (runtime)
      // kSingle (G == 1): a lane's key chunks are dc = tg + k * TGS1 for every token it
      // visits, so the matching q values are fixed per lane: they are read from q_s once per
      // chunk of tokens into registers (qf, float32) and the dot product reads no shared
      // memory. The multi-head path keeps the key in float32 instead (kf) and reads q from
      // q_s per head: G * KCPL * X q floats per lane would not fit in registers.
      auto k_pass = [&](auto single) {
        constexpr bool kSingle = decltype(single)::value;
        constexpr int KC = kSingle ? KCPL1 : KCPL;  // chunks per lane
        constexpr int TG = kTokenChunks / KC;       // lanes per token
        constexpr int TP = 32 / TG;                 // tokens per warp step
        const int tok = lane % TP;
        const int tg = lane / TP;
        float qf[kSingle ? KC : 1][X];
        if constexpr (kSingle) {
#pragma unroll
          for (int k = 0; k < KC; ++k) {
            const int dc = tg + k * TG;
#pragma unroll
            for (int i = 0; i < X; i += 4) {  // chunks past the head stay 0 (their key is 0)
              const float4 qv = dc < nck
                                    ? *reinterpret_cast<const float4*>(q_s + dc * X + i)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
              qf[k][i] = qv.x;
              qf[k][i + 1] = qv.y;
              qf[k][i + 2] = qv.z;
              qf[k][i + 3] = qv.w;
            }
          }
        }
        for (int t0 = warp * TP; t0 < n; t0 += kWarps * TP) {  // warp-uniform loop
          const int t = t0 + tok;
          const int blk = t < n ? blk_s[t / BS] : -1;
          const CT* kp = kc + static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride +
                        (t % BS) * k_tok;
          uint4 kr[KC];
#pragma unroll
          for (int k = 0; k < KC; ++k) {
            const int dc = tg + k * TG;
            kr[k] = (blk >= 0 && dc < nck) ? load_chunk(kp + dc * k_chunk) : zero_chunk();
          }
          // Reduces a lane's partial dot over the TG lanes of its token and stores the
          // logit of head h. All 32 lanes run this (the loops around it are warp-uniform).
          auto store_logit = [&](int h, float dot) {
#pragma unroll
            for (int m = TP; m < 32; m <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
            if (tg == 0 && t < n) {
              float logit = dot * p.qk_scale;
              if (p.alibi_slopes != nullptr) {
                logit += p.alibi_slopes[head0 + h] * static_cast<float>(c0 + t - L + 1);
              }
              logit_s[h * kChunkTokens + t] = logit;
            }
          };
          if constexpr (kSingle) {
            float dot = 0.f;
#pragma unroll
            for (int k = 0; k < KC; ++k) {
              float kf[X];
              chunk_to_float<CT>(kr[k], kf);
#pragma unroll
              for (int i = 0; i < X; ++i) dot += qf[k][i] * kf[i];
            }
            store_logit(0, dot);
          } else {
            // The key in float32 once, for all G heads (not once per head).
            float kf[KC][X];
#pragma unroll
            for (int k = 0; k < KC; ++k) chunk_to_float<CT>(kr[k], kf[k]);
            for (int h = 0; h < G; ++h) {
              const float* qh = q_s + h * HS;
              float dot = 0.f;
#pragma unroll
              for (int k = 0; k < KC; ++k) {
                const int dc = tg + k * TG;
                if (dc < nck) {  // q_s holds head_size floats per head
                  const float4* q4 = reinterpret_cast<const float4*>(qh + dc * X);
#pragma unroll
                  for (int i = 0; i < X / 4; ++i) {
                    const float4 qv = q4[i];
                    dot += qv.x * kf[k][4 * i] + qv.y * kf[k][4 * i + 1] +
                           qv.z * kf[k][4 * i + 2] + qv.w * kf[k][4 * i + 3];
                  }
                }
              }
              store_logit(h, dot);
            }
          }
        }
      };
      if (G == 1) {  // CTA-uniform
        k_pass(std::true_type{});
      } else {
        k_pass(std::false_type{});
      }
    }
    __syncthreads();

    // ---- softmax update, one warp per head: logits -> exp(logit - m_new) in place.
    for (int h = warp; h < G; h += kWarps) {  // warp-uniform
      float* lg = logit_s + h * kChunkTokens;
      float mx = -FLT_MAX;
      for (int t = lane; t < n; t += 32) mx = fmaxf(mx, lg[t]);
      mx = warp_max(mx);
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      // Up to the end of the last block: the V pass reads whole blocks, tail p = 0.
      for (int t = lane; t < nb * BS; t += 32) {
        const float e = t < n ? __expf(lg[t] - m_new) : 0.f;
        lg[t] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      // Every lane read m_s[h] above; a shuffle exchanges registers but orders no memory
      // accesses, so the warp meets here before lane 0 overwrites it.
      __syncwarp();
      if (lane == 0) {
        const float alpha = __expf(m_old - m_new);  // first chunk: exp(-huge) = 0
        alpha_s[h] = alpha;
        l_s[h] = l_s[h] * alpha + sum;
        m_s[h] = m_new;
      }
    }
    __syncthreads();

    // ---- V pass: acc = acc * alpha + sum_t p[t] * v[t].
    if (v_active) {  // warp-uniform
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerCta; ++h) {
        if (h < G) {
          const float a = alpha_s[h];
#pragma unroll
          for (int j = 0; j < RGW; ++j) acc[j][h] *= a;
        }
      }
      for (int b0 = split; b0 < nb; b0 += U * splits) {  // warp-uniform
        uint4 raw[U][RGW][UPR];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int b = b0 + u * splits;
          const int blk = b < nb ? blk_s[b] : -1;
          const CT* vb = vc + static_cast<int64_t>(blk < 0 ? 0 : blk) * p.kv_block_stride +
                         vunit * VX * (flash ? ts : 1);
#pragma unroll
          for (int j = 0; j < RGW; ++j) {
            const int rbase = (rg0 + j * wrg) * kGroupRows + vrow;
#pragma unroll
            for (int k = 0; k < UPR; ++k) {
              const int d = rbase + k * RPI;  // rows past the head (or the bucket) read 0
              raw[u][j][k] = blk < 0 || d >= HS ? zero_chunk()
                             : flash        ? load_unit_strided<CT, VX>(vb + d, ts)
                                            : load_unit<CT, VX>(vb + d * BS);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int b = b0 + u * splits;
          if (b < nb) {  // warp-uniform
            const int valid = n - b * BS;  // tokens of block b inside the chunk (>= 1)
            const float* pb = logit_s + b * BS + vunit * VX;  // this lane's VX tokens
#pragma unroll
            for (int j = 0; j < RGW; ++j) {
              if (rg0 + j * wrg < nrg) {  // warp-uniform
                float v[UPR][VX];
#pragma unroll
                for (int k = 0; k < UPR; ++k) {
                  unit_to_float<CT, VX>(raw[u][j][k], v[k]);
                  if (valid < BS) {  // slots past the end may hold anything (NaN * 0 = NaN)
#pragma unroll
                    for (int i = 0; i < VX; ++i) {
                      v[k][i] = vunit * VX + i < valid ? v[k][i] : 0.f;
                    }
                  }
                }
#pragma unroll
                for (int h = 0; h < kMaxHeadsPerCta; ++h) {
                  if (h < G) {  // CTA-uniform: every lane takes part in the shuffles
                    const float4* p4 = reinterpret_cast<const float4*>(pb + h * kChunkTokens);
                    float part[UPR];
#pragma unroll
                    for (int k = 0; k < UPR; ++k) part[k] = 0.f;
#pragma unroll
                    for (int i = 0; i < VX / 4; ++i) {
                      const float4 pv = p4[i];
#pragma unroll
                      for (int k = 0; k < UPR; ++k) {
                        part[k] += pv.x * v[k][4 * i] + pv.y * v[k][4 * i + 1] +
                                   pv.z * v[k][4 * i + 2] + pv.w * v[k][4 * i + 3];
                      }
                    }
                    acc[j][h] += reduce_scatter<UPR>(part, lane);
                  }
                }
              }
            }
          }
        }
      }
    }
    __syncthreads();  // logit_s / blk_s are rewritten by the next chunk
  }
  __syncthreads();  // running stats visible even when the loop did not run (empty seq)

  // ---- combine the splits (fewer row groups than warps), reusing the logit buffer.
  if (splits > 1) {  // CTA-uniform
    // (splits - 1) * G * HS <= 3 * G * 32 <= kChunkTokens * G floats
    float* red = logit_s;
    if (v_active && split > 0) {
#pragma unroll
      for (int j = 0; j < RGW; ++j) {
        const int d = (rg0 + j * wrg) * kGroupRows + vown;
        if (d < HS) {
#pragma unroll
          for (int h = 0; h < kMaxHeadsPerCta; ++h) {
            if (h < G) red[((split - 1) * G + h) * HS + d] = acc[j][h];
          }
        }
      }
    }
    __syncthreads();
    if (v_active && split == 0) {
      for (int s = 1; s < splits; ++s) {
#pragma unroll
        for (int j = 0; j < RGW; ++j) {
          const int d = (rg0 + j * wrg) * kGroupRows + vown;
          if (d < HS) {
#pragma unroll
            for (int h = 0; h < kMaxHeadsPerCta; ++h) {
              if (h < G) acc[j][h] += red[((s - 1) * G + h) * HS + d];
            }
          }
        }
      }
    }
  }

  // ---- output
  if (v_active && split == 0) {
#pragma unroll
    for (int h = 0; h < kMaxHeadsPerCta; ++h) {
      if (h < G) {
        const float l = l_s[h];
        const float inv = l > 0.f ? p.v_scale / l : 0.f;
        const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head0 + h;
        T* o = static_cast<T*>(p.out) +
               (is_v2 ? (row * p.num_partitions + part) * HS : row * HS);
#pragma unroll
        for (int j = 0; j < RGW; ++j) {
          const int d = (rg0 + j * wrg) * kGroupRows + vown;
          if (d < HS) o[d] = from_float<T>(acc[j][h] * inv);
        }
      }
    }
  }
  if (is_v2 && tid < G) {
    const int64_t idx =
        (static_cast<int64_t>(seq) * p.num_heads + head0 + tid) * p.num_partitions + part;
    p.max_logits[idx] = m_s[tid];
    p.exp_sums[idx] = l_s[tid];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) paged_attention_v2_reduce_kernel(
    const ReduceParams p) {
  constexpr int kTile = 256;  // partitions whose weights are staged at once
  constexpr int ROWS = kMaxHeadSize / kThreads;  // output rows per thread
  static_assert(ROWS * kThreads == kMaxHeadSize, "every row of the largest head has a thread");
  __shared__ float w_s[kTile];
  __shared__ float red_s[kWarps];

  const int tid = threadIdx.x;
  const int seq = blockIdx.x / p.num_heads;
  const int head = blockIdx.x - seq * p.num_heads;
  const int HS = p.head_size;
  const int P = p.num_partitions;
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  T* out = static_cast<T*>(p.out) + row * HS;

  const int64_t L = min(static_cast<int64_t>(max(p.seq_lens[seq], 0)), p.max_tokens);
  const int np = static_cast<int>((L + kChunkTokens - 1) / kChunkTokens);  // <= P
  if (np == 0) {  // CTA-uniform exits
    for (int d = tid; d < HS; d += kThreads) out[d] = from_float<T>(0.f);
    return;
  }
  const T* tmp = static_cast<const T*>(p.tmp_out) + row * P * HS;
  if (np == 1) {
    for (int d = tid; d < HS; d += kThreads) out[d] = tmp[d];
    return;
  }
  const float* ml = p.max_logits + row * P;
  const float* es = p.exp_sums + row * P;

  float m = -FLT_MAX;
  for (int i = tid; i < np; i += kThreads) m = fmaxf(m, ml[i]);
  m = block_max(m, red_s);
  float w = 0.f;
  for (int i = tid; i < np; i += kThreads) w += es[i] * __expf(ml[i] - m);
  w = block_sum(w, red_s);
  const float inv = w > 0.f ? 1.f / w : 0.f;

  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int p0 = 0; p0 < np; p0 += kTile) {
    const int cnt = min(kTile, np - p0);
    for (int i = tid; i < cnt; i += kThreads) w_s[i] = es[p0 + i] * __expf(ml[p0 + i] - m);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int d = tid + r * kThreads;
      if (d < HS) {
        const T* tp = tmp + static_cast<int64_t>(p0) * HS + d;
        float a = 0.f;
        for (int i = 0; i < cnt; ++i) a += w_s[i] * to_float(tp[static_cast<int64_t>(i) * HS]);
        acc[r] += a;
      }
    }
    __syncthreads();  // w_s is rewritten by the next tile
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int d = tid + r * kThreads;
    if (d < HS) out[d] = from_float<T>(acc[r] * inv);
  }
}

// Host-side launch planning, shared by the launchers (paged_attention_v1/v2.cu) and the
// CPU emulation of the kernels (tests/cuda_emulation), so both run the same grids.

// The instantiation of paged_attention_kernel that serves (block_size, head_size):
// HEAD_MAX is the bucket (64, 128 or 256) head_size falls in; CT the cache element (T, or
// fp8_e4m3 / fp8_e5m2). Launched with <<<grid, kThreads, attention_smem_bytes(...)>>>.
using AttentionKernel = void (*)(AttentionParams);

// One instance of paged_attention_kernel. get() is defined in kernel_instances.cuh, which
// only the generated instantiation files (csrc/cuda/generate_kernels.py) and the CPU
// emulator include: a launcher that includes this header compiles no kernel.
template <typename T, typename CT, int BLOCK_SIZE, int HEAD_MAX>
struct AttentionInstance {
  static AttentionKernel get();
};

__host__ __device__ constexpr int attention_head_bucket(int head_size) {
  return head_size <= 64 ? 64 : (head_size <= 128 ? 128 : kMaxHeadSize);
}

// One instance of paged_attention_tc_kernel (attention_tc_kernels.cuh), declared like
// AttentionInstance; HEAD is the head size (64 or 128).
template <typename T, typename CT, int BLOCK_SIZE, int HEAD>
struct AttentionTcInstance {
  static AttentionKernel get();
};

// The tensor-core kernel's CTA shape: up to kTcMaxHeadsPerCta query heads (the M rows of
// an MMA tile), tc_warps(head_size) warps.
constexpr int kTcMaxHeadsPerCta = 16;
__host__ __device__ constexpr int tc_warps(int head_size) { return head_size <= 64 ? 4 : 2; }
__host__ __device__ constexpr int tc_threads(int head_size) { return 32 * tc_warps(head_size); }

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite

#include <c10/util/Exception.h>  // TORCH_CHECK in the kernel lookups below

#include "attention_path.h"
#include "kernel_build_config.h"     // generated: the build options
#include "paged_attention_table.h"  // generated: paged_attention_table<T, CT>
#include "paged_attention_tc_table.h"  // generated: paged_attention_tc_table<T, CT>

namespace vllm_lite {
namespace cuda {
namespace attn {

template <typename T, typename CT>
AttentionKernel attention_kernel_for(int block_size, int head_size) {
  static_assert(kMaxHeadSize <= 256, "the largest head-size bucket is 256");
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32,
              "paged_attention: block_size ", block_size,
              " is not supported on CUDA; use 8, 16 or 32");
  const AttentionKernel kernel =
      paged_attention_table<T, CT>(block_size, attention_head_bucket(head_size));
  TORCH_CHECK(kernel != nullptr, "paged_attention: this build has no CUDA kernel for head_size ",
              head_size, " with kv_cache_dtype ", cache_dtype_name<T, CT>(),
              ": it was built with ", kKernelBuildSettings,
              "; rebuild with them unset (every kernel) or including this case");
  return kernel;
}

// How the query heads of one kv head are split over CTAs (see the grid above).
struct CtaSplit {
  int64_t ctas_per_kv_head;
  int64_t heads_per_cta;
};

// At most kMaxHeadsPerCta heads per CTA, balanced over the CTAs of a kv head; fewer when
// the grid would otherwise leave SMs idle (K/V are then shared through L2). `sms` is the
// device's multiprocessor count.
inline CtaSplit split_heads_over_ctas(int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                                      int64_t grid_partitions, int64_t sms) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t ctas = cdiv(group, kMaxHeadsPerCta);
  int64_t hpc = cdiv(group, ctas);
  while (hpc > 1 && num_seqs * num_kv_heads * ctas * grid_partitions < 2 * sms) {
    ctas = group < ctas * 2 ? group : ctas * 2;
    hpc = cdiv(group, ctas);
    ctas = cdiv(group, hpc);
  }
  return {ctas, hpc};
}

// How a decode launch runs (the launchers and the emulator's replay of them use this).
struct DecodeLaunch {
  DecodePath path;
  AttentionKernel kernel;
  CtaSplit split;
  int threads;
  size_t smem;  // dynamic shared memory
};

// The kernel, CTA split, block and shared memory of one paged-attention launch for query
// dtype T and cache element CT on a device of compute capability `cc` with `sms`
// multiprocessors: decode_path (attention_path.h) chooses the kernel; a tensor-core
// choice this build has no instance for falls back to the SIMT kernel.
template <typename T, typename CT>
DecodeLaunch plan_decode_launch(int cc, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                                int64_t head_size, int block_size, int64_t grid_partitions,
                                int64_t sms) {
  constexpr bool k16 = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;
  if (decode_path(cc, k16, group, head_size) == DecodePath::kTensorCore) {
    const AttentionKernel kernel =
        paged_attention_tc_table<T, CT>(block_size, static_cast<int>(head_size));
    if (kernel != nullptr) {
      const int64_t ctas = (group + kTcMaxHeadsPerCta - 1) / kTcMaxHeadsPerCta;
      const int64_t hpc = (group + ctas - 1) / ctas;
      return {DecodePath::kTensorCore, kernel, {ctas, hpc},
              tc_threads(static_cast<int>(head_size)), 0};
    }
  }
  const CtaSplit split = split_heads_over_ctas(num_seqs, num_kv_heads, group, grid_partitions, sms);
  return {DecodePath::kSimt,
          attention_kernel_for<T, CT>(block_size, static_cast<int>(head_size)), split, kThreads,
          attention_smem_bytes(static_cast<int>(split.heads_per_cta),
                               static_cast<int>(head_size))};
}

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
