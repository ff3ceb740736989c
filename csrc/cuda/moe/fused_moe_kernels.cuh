// The CUDA kernels of fused_moe (SIMT), launched in this order on one stream by
// fused_moe.cu (and by the emulator, tests/cuda_emulation/emu_moe.cpp), with no host
// round trip between them (so the op needs no device sync):
//   moe_route_kernel<L>     one thread per token: softmax of its E logits (L: the logits'
//                           type) in float32, the top_k largest (ties to the lower expert
//                           id; a NaN never wins, so the ids stay distinct and in range),
//                           renormalised if asked: topk_w float [T, k], topk_id int [T, k]
//   moe_sort_kernel         one block, one thread per expert: a stable counting sort of the
//                           P = T * k (token, slot) pairs by expert: sorted_pair[r] = the
//                           pair at row r of the grouped order, row_of_pair[p] its inverse
//   moe_gate_up_kernel<T>   the grouped gate_up GEMM over the sorted rows, SiLU-and-mul in
//                           its epilogue: grid (P, ceil(I / threads)), one thread per (row,
//                           output feature), act [P, I]
//   moe_down_kernel<T>      the grouped down GEMM: grid (P, ceil(H / threads)), ys [P, H]
//   moe_combine_kernel<T>   per (token, feature): the sum of its k rows times their
//                           routing weights in float32, rounded once: out [T, H]
// Rounding as the CPU op and the unfused layers: the gate and up projections, the silu,
// their product and each expert's output rounded to T. Each row reads its expert's
// weights only: an expert no token chose is never read.
#pragma once

#include <cstdint>

#include "cuda/dtype.cuh"
#include "cuda/elementwise/elementwise_kernels.cuh"  // ew::silu_f32, ew::round_to
#include "moe_limits.h"

namespace vllm_lite {
namespace cuda {
namespace moe {

// Threads per block of the GEMM and combine kernels, and of the routing kernel.
constexpr int kMoeThreads = 128;
// The sort kernel's block: one thread per expert.
constexpr int kMoeSortThreads = kMoeMaxNumExperts;
static_assert(kMoeSortThreads <= 1024, "one thread per expert must fit a block");

template <typename L>
__global__ void moe_route_kernel(const L* __restrict__ logits, int tokens, int experts,
                                 int top_k, bool renormalize, float* __restrict__ topk_w,
                                 int* __restrict__ topk_id) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const L* row = logits + static_cast<int64_t>(t) * experts;
  float m = -INFINITY;
  for (int e = 0; e < experts; ++e) m = fmaxf(m, to_float(row[e]));
  float sum = 0.0f;
  for (int e = 0; e < experts; ++e) sum += expf(to_float(row[e]) - m);
  unsigned chosen[kMoeMaxNumExperts / 32];
  for (int i = 0; i < kMoeMaxNumExperts / 32; ++i) chosen[i] = 0u;
  float total = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    int best = -1;
    float best_p = 0.0f;
    for (int e = 0; e < experts; ++e) {
      if ((chosen[e / 32] >> (e % 32)) & 1u) continue;
      const float p = expf(to_float(row[e]) - m) / sum;
      if (best < 0 || p > best_p) {
        best = e;
        best_p = p;
      }
    }
    chosen[best / 32] |= 1u << (best % 32);
    topk_w[static_cast<int64_t>(t) * top_k + j] = best_p;
    topk_id[static_cast<int64_t>(t) * top_k + j] = best;
    total += best_p;
  }
  if (renormalize) {
    for (int j = 0; j < top_k; ++j) topk_w[static_cast<int64_t>(t) * top_k + j] /= total;
  }
}

// Launch with one block of kMoeSortThreads threads.
__global__ void moe_sort_kernel(const int* __restrict__ topk_id, int pairs, int experts,
                                int* __restrict__ sorted_pair, int* __restrict__ row_of_pair) {
  __shared__ int start[kMoeSortThreads + 1];
  const int e = threadIdx.x;
  int count = 0;
  if (e < experts) {
    for (int p = 0; p < pairs; ++p) count += topk_id[p] == e ? 1 : 0;
  }
  start[e + 1] = count;
  __syncthreads();
  if (e == 0) {
    start[0] = 0;
    for (int i = 0; i < kMoeSortThreads; ++i) start[i + 1] += start[i];
  }
  __syncthreads();
  if (e < experts) {
    int r = start[e];
    for (int p = 0; p < pairs; ++p) {
      if (topk_id[p] == e) {
        sorted_pair[r] = p;
        row_of_pair[p] = r;
        ++r;
      }
    }
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
