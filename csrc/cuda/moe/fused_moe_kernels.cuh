// The CUDA kernels of fused_moe (SIMT, and tensor-core GEMMs on sm_80+), launched in this
// order on one stream by fused_moe.cu (and by the emulator,
// tests/cuda_emulation/emu_moe.cpp), with no host round trip between them (so the op needs
// no device sync):
//   moe_route_kernel<L>     one warp per token: softmax of its E logits (L: the logits'
//                           type) in float32, the top_k largest (ties to the lower expert
//                           id; the ids stay distinct and in range whatever the values),
//                           renormalised if asked: topk_w float [T, k], topk_id int [T, k]
//   moe_sort_kernel         one block of kMoeSortThreads: a counting sort of the P = T * k
//                           (token, slot) pairs by expert (not stable: see the kernel):
//                           sorted_pair[r] = the pair at row r of the grouped order,
//                           row_of_pair[p] its inverse; and the tile table
//                           (fused_moe_path.h) of the tensor-core GEMMs
//   then the two grouped GEMMs, on the path moe_path() picks:
//   SIMT (every dtype and GPU):
//   moe_gate_up_kernel<T>   the grouped gate_up GEMM over the sorted rows, SiLU-and-mul in
//                           its epilogue: grid (P, ceil(I / threads)), one thread per (row,
//                           output feature), act [P, I]
//   moe_down_kernel<T>      the grouped down GEMM: grid (P, ceil(H / threads)), ys [P, H]
//   tensor cores (sm_80+, f16 / bf16; moe_tc_gemm_kernel<T, GATE_UP>, see below):
//                           grid (moe_tc_max_tiles, ceil(N / kMoeTcCols)), kMoeTcWarps warps:
//                           a block multiplies one tile's 16 rows (one expert's) by
//                           kMoeTcCols of that expert's weight rows, so each weight element
//                           is read once per tile instead of once per row
//   moe_combine_kernel<T>   per (token, feature): the sum of its k rows times their
//                           routing weights in float32, rounded once: out [T, H]
// Rounding as the CPU op and the unfused layers: the gate and up projections, the silu,
// their product and each expert's output rounded to T. Each row reads its expert's
// weights only: an expert no token chose is never read.
#pragma once

#include <cstdint>

#include "cuda/dtype.cuh"
#include "cuda/elementwise/elementwise_kernels.cuh"  // ew::silu_f32, ew::round_to
#include "cuda/mma.cuh"
#include "cuda/warp.cuh"
#include "cuda/moe/fused_moe_path.h"
#include "moe_limits.h"

namespace vllm_lite {
namespace cuda {
namespace moe {

// Threads per block of the GEMM and combine kernels, and of the routing kernel (a warp
// per token).
constexpr int kMoeThreads = 128;
// The sort kernel's block: one thread per expert (its count and prefix sums).
constexpr int kMoeSortThreads = kMoeMaxNumExperts;
static_assert(kMoeSortThreads <= 1024, "one thread per expert must fit a block");

// Whether candidate (p, e) of the routing's top-k beats (bp, be): the larger probability,
// the lower expert id on a tie; kMoeNoExpert loses to any expert. A softmax with a NaN is
// NaN everywhere (fmaxf skips a NaN logit, which then makes the sum NaN; an infinite one
// makes inf - inf), so NaNs tie among themselves and the lowest unchosen ids win, as the
// CPU op's sequential scan picks them.
constexpr int kMoeNoExpert = kMoeMaxNumExperts;
__device__ __forceinline__ bool route_beats(float p, int e, float bp, int be) {
  if (e == kMoeNoExpert) return false;
  if (be == kMoeNoExpert || p > bp) return true;
  const bool tie = p == bp || (p != p && bp != bp);
  return tie && e < be;
}

// One warp per token, kMoeRouteTokens tokens a block of kMoeThreads: lane l keeps the
// probabilities of experts l, l + 32, ... in registers (coalesced loads of the logits);
// the max and the sum are warp reductions, and each of the top_k picks is a warp argmax
// (route_beats) over the lanes' best unchosen experts.
constexpr int kMoeRouteTokens = kMoeThreads / 32;
template <typename L>
__global__ void moe_route_kernel(const L* __restrict__ logits, int tokens, int experts,
                                 int top_k, bool renormalize, float* __restrict__ topk_w,
                                 int* __restrict__ topk_id) {
  constexpr int kPerLane = kMoeMaxNumExperts / 32;
  static_assert(kMoeMaxNumExperts % 32 == 0 && kPerLane <= 32, "a lane's chosen bits fit");
  const int lane = threadIdx.x % 32;
  const int t = blockIdx.x * kMoeRouteTokens + threadIdx.x / 32;
  if (t >= tokens) return;  // the whole warp: t is the warp's
  const L* row = logits + static_cast<int64_t>(t) * experts;
  float p[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < experts ? to_float(row[e]) : -INFINITY;
    m = fmaxf(m, p[j]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (lane + 32 * j < experts) {
      p[j] = expf(p[j] - m);
      sum += p[j];
    }
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) p[j] /= sum;
  unsigned chosen = 0u;  // bit j: expert lane + 32 j is taken
  float total = 0.0f;
  for (int s = 0; s < top_k; ++s) {
    float bp = 0.0f;
    int be = kMoeNoExpert;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < experts && !((chosen >> j) & 1u) && route_beats(p[j], e, bp, be)) {
        bp = p[j];
        be = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (route_beats(op, oe, bp, be)) {
        bp = op;
        be = oe;
      }
    }
    if (be % 32 == lane) chosen |= 1u << (be / 32);
    if (lane == 0) {
      topk_w[static_cast<int64_t>(t) * top_k + s] = bp;
      topk_id[static_cast<int64_t>(t) * top_k + s] = be;
    }
    total += bp;
  }
  if (renormalize && lane == 0) {
    for (int s = 0; s < top_k; ++s) topk_w[static_cast<int64_t>(t) * top_k + s] /= total;
  }
}

// Launch with one block of kMoeSortThreads threads. tiles: moe_tile_table_ints(P, E) ints.
// The threads stride over the pairs (each touches P / kMoeSortThreads of them, twice), so
// a prefill's thousands of pairs cost a few passes, not one thread per expert reading all
// of them: the counts are shared-memory atomics, their prefix sums (rows and tiles) a
// warp-shuffle scan, and each pair takes the next free row of its expert by an atomic
// too. An expert's rows are therefore in no particular token order; nothing depends on
// it (each grouped row's products are computed alone, and the combine kernel finds a
// pair's row through row_of_pair), so the op's output does not change with it.
__global__ void moe_sort_kernel(const int* __restrict__ topk_id, int pairs, int experts,
                                int* __restrict__ sorted_pair, int* __restrict__ row_of_pair,
                                int* __restrict__ tiles) {
  constexpr int kWarps = kMoeSortThreads / 32;
  static_assert(kMoeSortThreads % 32 == 0 && kWarps <= 32, "the scan's warp sums fit a warp");
  __shared__ int next_row[kMoeSortThreads];  // an expert's count, then its next free row
  __shared__ int warp_rows[kWarps], warp_tiles[kWarps];
  const int e = threadIdx.x, lane = e % 32, warp = e / 32;
  next_row[e] = 0;
  __syncthreads();
  // The routing kernel wrote every id in [0, experts).
  for (int p = e; p < pairs; p += kMoeSortThreads) atomicAdd(&next_row[topk_id[p]], 1);
  __syncthreads();
  const int rows = next_row[e];  // 0 past `experts`
  const int n_tiles = (rows + kMoeTcRows - 1) / kMoeTcRows;
  // Inclusive prefix sums over the experts: within each warp, then the warps' totals.
  const int row_end = warp_inclusive_sum(rows), tile_end = warp_inclusive_sum(n_tiles);
  if (lane == 31) {
    warp_rows[warp] = row_end;
    warp_tiles[warp] = tile_end;
  }
  __syncthreads();
  if (warp == 0) {
    const int r = warp_inclusive_sum(lane < kWarps ? warp_rows[lane] : 0);
    const int t = warp_inclusive_sum(lane < kWarps ? warp_tiles[lane] : 0);
    if (lane < kWarps) {  // exclusive: the warps before this one
      warp_rows[lane] = r - warp_rows[lane];
      warp_tiles[lane] = t - warp_tiles[lane];
    }
  }
  __syncthreads();
  const int start = warp_rows[warp] + row_end - rows;
  const int first_tile = warp_tiles[warp] + tile_end - n_tiles;
  if (e == kMoeSortThreads - 1) tiles[0] = first_tile + n_tiles;
  if (e < experts) {
    for (int j = 0, row = start; j < n_tiles; ++j, row += kMoeTcRows) {
      tiles[1 + 3 * (first_tile + j)] = e;
      tiles[2 + 3 * (first_tile + j)] = row;
      tiles[3 + 3 * (first_tile + j)] = min(kMoeTcRows, start + rows - row);
    }
  }
  next_row[e] = start;
  __syncthreads();
  for (int p = e; p < pairs; p += kMoeSortThreads) {
    const int r = atomicAdd(&next_row[topk_id[p]], 1);
    sorted_pair[r] = p;
    row_of_pair[p] = r;
  }
}

// act[r, c] for row r = blockIdx.x of the sorted order and c = blockIdx.y * blockDim.x +
// threadIdx.x < inter: silu(x w13[e, c]) * (x w13[e, inter + c]).
template <typename T>
__global__ void moe_gate_up_kernel(const T* __restrict__ hidden, const T* __restrict__ w13,
                                   const int* __restrict__ sorted_pair,
                                   const int* __restrict__ topk_id, int top_k, int hid,
                                   int inter, T* __restrict__ act) {
  const int r = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= inter) return;
  const int p = sorted_pair[r];
  const int64_t e = topk_id[p];
  const T* x = hidden + static_cast<int64_t>(p / top_k) * hid;
  const T* wg = w13 + (e * 2 * inter + c) * hid;
  const T* wu = wg + static_cast<int64_t>(inter) * hid;
  float gate = 0.0f, up = 0.0f;
  for (int h = 0; h < hid; ++h) {
    const float xv = to_float(x[h]);
    gate += xv * to_float(wg[h]);
    up += xv * to_float(wu[h]);
  }
  const float a = ew::round_to<T>(ew::silu_f32(ew::round_to<T>(gate)));
  act[static_cast<int64_t>(r) * inter + c] = from_float<T>(__fmul_rn(a, ew::round_to<T>(up)));
}

// ys[r, c] = act[r] . w2[e, c] for c = blockIdx.y * blockDim.x + threadIdx.x < hid.
template <typename T>
__global__ void moe_down_kernel(const T* __restrict__ act, const T* __restrict__ w2,
                                const int* __restrict__ sorted_pair,
                                const int* __restrict__ topk_id, int hid, int inter,
                                T* __restrict__ ys) {
  const int r = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= hid) return;
  const int64_t e = topk_id[sorted_pair[r]];
  const T* a = act + static_cast<int64_t>(r) * inter;
  const T* w = w2 + (e * hid + c) * inter;
  float acc = 0.0f;
  for (int i = 0; i < inter; ++i) acc += to_float(a[i]) * to_float(w[i]);
  ys[static_cast<int64_t>(r) * hid + c] = from_float<T>(acc);
}

// The tensor-core GEMMs' block: kMoeTcWarps warps, each owning kMoeTcColsPerWarp output
// columns (two n8 MMA tiles), kMoeTcCols columns in all.
constexpr int kMoeTcWarps = 4;
constexpr int kMoeTcColsPerWarp = 16;
constexpr int kMoeTcCols = kMoeTcWarps * kMoeTcColsPerWarp;
// K consumed per step: each lane loads one 16-byte chunk (kMoeTcChunk elements) of each of
// its rows, four lanes cover 32 consecutive k.
constexpr int kMoeTcK = 4 * kMoeTcChunk;

__device__ __forceinline__ uint32_t chunk_word(const uint4& c, int i) {
  return i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
}

// One tile (tiles[1 + 3 * blockIdx.x ...]: expert e, first grouped row, rows <= 16) times
// columns blockIdx.y * kMoeTcCols ... of e's weights, K = the rows' length, N = the
// output's width; f32 accumulation in mma.m16n8k16.
//   GATE_UP: A row i = hidden[token of sorted_pair[first + i]] (K = H), B = w13[e]'s gate
//            rows n and up rows N + n (N = I); epilogue silu(gate) * up rounded as the SIMT
//            kernel rounds, into act[first + i, n].
//   down:    A row i = act[first + i] (K = I), B = w2[e]'s rows n (N = H), into
//            ys[first + i, n].
// The k order: within each 32-wide step lane t holds elements 8t .. 8t+7 of its rows
// (one 16-byte load) and feeds 8t .. 8t+3 to the first k16 MMA and 8t+4 .. 8t+7 to the
// second, in the fragment slots of k 2t, 2t+1, 2t+8, 2t+9. A and B use the same order, so
// each MMA pair sums the same 32 products, only in another order. Rows past the tile's
// and columns past N read zeros and are not stored; K % kMoeTcChunk == 0 (moe_path), so a
// chunk lies wholly inside K or wholly past it.
template <typename T, bool GATE_UP>
__global__ void __launch_bounds__(kMoeTcWarps * 32)
    moe_tc_gemm_kernel(const T* __restrict__ a_src, const T* __restrict__ w,
                       const int* __restrict__ tiles, const int* __restrict__ sorted_pair,
                       int top_k, int K, int N, T* __restrict__ out) {
#if VLLM_LITE_TC_AVAILABLE
  const int tile = blockIdx.x;
  if (tile >= tiles[0]) return;  // the grid is sized for the most tiles P rows can need
  const int e = tiles[1 + 3 * tile], first = tiles[2 + 3 * tile], rows = tiles[3 + 3 * tile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int n_warp = blockIdx.y * kMoeTcCols + warp * kMoeTcColsPerWarp;
  if (n_warp >= N) return;  // a whole warp past N (no block-wide barrier follows)
  constexpr int NT = kMoeTcColsPerWarp / 8;  // n8 tiles per warp
  constexpr int NB = GATE_UP ? 2 : 1;         // weight row sets: gate and up, or down
  const T* arow[2];                           // rows g and g + 8 of the tile
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = g + 8 * h;
    const int64_t src = i >= rows ? -1
                        : GATE_UP ? sorted_pair[first + i] / top_k
                                  : static_cast<int64_t>(first + i);
    arow[h] = src < 0 ? nullptr : a_src + src * K;
  }
  const T* brow[NB][NT];
  const T* wexp = w + static_cast<int64_t>(e) * NB * N * K;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = n_warp + 8 * j + g;
      brow[b][j] = n < N ? wexp + (static_cast<int64_t>(b) * N + n) * K : nullptr;
    }
  }
  float acc[NB][NT][4];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[b][j][q] = 0.0f;
    }
  }
  for (int k0 = 0; k0 < K; k0 += kMoeTcK) {
    const int k = k0 + kMoeTcChunk * t;
    const bool in_k = k < K;
    uint4 ac[2], bc[NB][NT];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ac[h] = in_k && arow[h] != nullptr ? load_chunk(arow[h] + k) : zero_chunk();
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        bc[b][j] = in_k && brow[b][j] != nullptr ? load_chunk(brow[b][j] + k) : zero_chunk();
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t a[4] = {chunk_word(ac[0], 2 * s), chunk_word(ac[1], 2 * s),
                             chunk_word(ac[0], 2 * s + 1), chunk_word(ac[1], 2 * s + 1)};
#pragma unroll
      for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t bb[2] = {chunk_word(bc[b][j], 2 * s), chunk_word(bc[b][j], 2 * s + 1)};
          tc::mma_m16n8k16<T>(acc[b][j], a, bb, acc[b][j]);
        }
      }
    }
  }
  // C fragment: acc[.][j][2h + q] is row g + 8h, column n_warp + 8j + 2t + q.
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = g + 8 * h;
      if (i >= rows) continue;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int n = n_warp + 8 * j + 2 * t + q;
        if (n >= N) continue;
        T* dst = out + static_cast<int64_t>(first + i) * N + n;
        if constexpr (GATE_UP) {
          const float a = ew::round_to<T>(ew::silu_f32(ew::round_to<T>(acc[0][j][2 * h + q])));
          *dst = from_float<T>(__fmul_rn(a, ew::round_to<T>(acc[1][j][2 * h + q])));
        } else {
          *dst = from_float<T>(acc[0][j][2 * h + q]);
        }
      }
    }
  }
#endif
}

// out[t, c] = sum over j < top_k of topk_w[t, j] * ys[row_of_pair[t * top_k + j], c].
template <typename T>
__global__ void moe_combine_kernel(const T* __restrict__ ys, const float* __restrict__ topk_w,
                                   const int* __restrict__ row_of_pair, int top_k, int hid,
                                   T* __restrict__ out) {
  const int t = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= hid) return;
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t p = static_cast<int64_t>(t) * top_k + j;
    acc += topk_w[p] * to_float(ys[static_cast<int64_t>(row_of_pair[p]) * hid + c]);
  }
  out[static_cast<int64_t>(t) * hid + c] = from_float<T>(acc);
}

}  // namespace moe
}  // namespace cuda
}  // namespace vllm_lite
