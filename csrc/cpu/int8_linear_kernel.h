// int8 and int4 weight-only linear on the CPU, built once per instruction set (like
// attention_kernel.h): the including file defines VLLM_LITE_INT8_FN / VLLM_LITE_INT4_FN, the
// names of the functions that return this build's block kernels, and sets the target ISA.
//
//   int8: y[m, n] = scales[n] * sum_k x[m, k] * q[n, k] (+ bias[n]); with groups of G
//         (GGUF Q8_0): y[m, n] = sum_k x[m, k] * (q[n, k] * scales[n, k / G]) (+ bias[n])
//   int4: y[m, n] = sum_k x[m, k] * (q[n, k] * scales[n, k / G] + zeros[n, k / G]) (+ bias[n])
//         q [N, K / 2] uint8, k = 2j in byte j's low nibble, 2j + 1 in its high nibble;
//         scales, zeros [N, K / G] float32, G = group_size (32, 64 or 128).
//
// Layouts: x [M, K] float32, rows contiguous; q [N, K] int8 contiguous (a weight row per
// output channel, nn.Linear's layout); scales [N], bias [N] (or null) float32; y [M, N]
// float32 contiguous. One call covers the output channels [n0, n1) for every row of x:
// kInt8RowsPerPass weight rows are widened to float32 once into `wbuf`
// (kInt8RowsPerPass x K floats, the caller's) and used by all M rows, so each weight byte is
// read from memory once per call (int8: a quarter of a float32 weight's traffic, int4 an
// eighth plus two floats per group); decode GEMMs
// (few rows) are memory-bound, which is where this wins. The K loops are plain loops under
// `omp simd` so the compiler vectorizes them for the ISA of the including file (8 floats on
// AVX2, NEON on aarch64).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/int8_linear_params.h"

namespace vllm_lite::cpu {
namespace {

// y[m, n + j] = dot(x[m], wbuf row j) * row_scale(j) + bias[n + j] for the nb <= 4 widened
// weight rows of one pass and every row m of x.
template <typename RowScale>
inline void dot_pass(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                     const float* wbuf, int64_t nb, const float* bias, float* y, int64_t N,
                     int64_t n, RowScale row_scale) {
  int64_t m = 0;
  if (nb == kInt8RowsPerPass) {
    // Two activation rows per pass over the weights: each widened weight value loaded
    // from L1 feeds two FMAs (8 accumulators fit the vector registers).
    const float* w0 = wbuf;
    const float* w1 = wbuf + K;
    const float* w2 = wbuf + 2 * K;
    const float* w3 = wbuf + 3 * K;
    for (; m + 1 < M; m += 2) {
      const float* xa = x + m * x_row_stride;
      const float* xb = xa + x_row_stride;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      float b0 = 0.f, b1 = 0.f, b2 = 0.f, b3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
      for (int64_t k = 0; k < K; ++k) {
        const float u = xa[k], v = xb[k];
        const float c0 = w0[k], c1 = w1[k], c2 = w2[k], c3 = w3[k];
        a0 += u * c0;
        a1 += u * c1;
        a2 += u * c2;
        a3 += u * c3;
        b0 += v * c0;
        b1 += v * c1;
        b2 += v * c2;
        b3 += v * c3;
      }
      const float ra[kInt8RowsPerPass] = {a0, a1, a2, a3};
      const float rb[kInt8RowsPerPass] = {b0, b1, b2, b3};
      float* ya = y + m * N + n;
      float* yb = ya + N;
      for (int64_t j = 0; j < kInt8RowsPerPass; ++j) {
        const float add = bias != nullptr ? bias[n + j] : 0.f;
        ya[j] = ra[j] * row_scale(j) + add;
        yb[j] = rb[j] * row_scale(j) + add;
      }
    }
  }
  for (; m < M; ++m) {  // the last odd row, or every row of a short pass
    const float* xr = x + m * x_row_stride;
    float acc[kInt8RowsPerPass] = {};
    if (nb == kInt8RowsPerPass) {
      // One pass over x's row for all the rows of the pass.
      const float* w0 = wbuf;
      const float* w1 = wbuf + K;
      const float* w2 = wbuf + 2 * K;
      const float* w3 = wbuf + 3 * K;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < K; ++k) {
        const float xv = xr[k];
        a0 += xv * w0[k];
        a1 += xv * w1[k];
        a2 += xv * w2[k];
        a3 += xv * w3[k];
      }
      acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
    } else {
      for (int64_t j = 0; j < nb; ++j) {
        const float* w = wbuf + j * K;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += xr[k] * w[k];
        acc[j] = s;
      }
    }
    float* yr = y + m * N + n;
    for (int64_t j = 0; j < nb; ++j) {
      yr[j] = acc[j] * row_scale(j) + (bias != nullptr ? bias[n + j] : 0.f);
    }
  }
}

void int8_linear_block(const Int8LinearArgs& a, int64_t n0, int64_t n1, float* wbuf) {
  const int64_t K = a.K, G = a.group_size;
  for (int64_t n = n0; n < n1; n += kInt8RowsPerPass) {
    const int64_t nb = std::min<int64_t>(kInt8RowsPerPass, n1 - n);
    for (int64_t j = 0; j < nb; ++j) {
      const int8_t* qr = a.q + (n + j) * K;
      float* w = wbuf + j * K;
      if (G == 0) {
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) w[k] = static_cast<float>(qr[k]);
        continue;
      }
      // groups: the weight itself, q * scale (the dequantized float32 weight), no row scale
      const float* sc = a.scales + (n + j) * (K / G);
      for (int64_t g0 = 0; g0 < K; g0 += G) {
        const float s = sc[g0 / G];
#pragma omp simd
        for (int64_t k = g0; k < g0 + G; ++k) w[k] = static_cast<float>(qr[k]) * s;
      }
    }
    const float* scales = a.scales + n;
    if (G == 0) {
      dot_pass(a.x, a.x_row_stride, a.M, K, wbuf, nb, a.bias, a.y, a.N, n,
               [scales](int64_t j) { return scales[j]; });
    } else {
      dot_pass(a.x, a.x_row_stride, a.M, K, wbuf, nb, a.bias, a.y, a.N, n,
               [](int64_t) { return 1.0f; });
    }
  }
}

// int4: each weight row's nibbles widened with its groups' scale and zero applied
// (w = q * scale + zero), then the same dot passes with no output scale.
void int4_linear_block(const Int4LinearArgs& a, int64_t n0, int64_t n1, float* wbuf) {
  const int64_t K = a.K, G = a.group_size, groups = K / G;
  for (int64_t n = n0; n < n1; n += kInt8RowsPerPass) {
    const int64_t nb = std::min<int64_t>(kInt8RowsPerPass, n1 - n);
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* qr = a.q + (n + j) * (K / 2);
      const float* sc = a.scales + (n + j) * groups;
      const float* zr = a.zeros + (n + j) * groups;
      float* w = wbuf + j * K;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = sc[g], z = zr[g];
        const uint8_t* qg = qr + g * (G / 2);
        float* wg = w + g * G;
#pragma omp simd
        for (int64_t i = 0; i < G / 2; ++i) {
          wg[2 * i] = static_cast<float>(qg[i] & 0xF) * s + z;
          wg[2 * i + 1] = static_cast<float>(qg[i] >> 4) * s + z;
        }
      }
    }
    dot_pass(a.x, a.x_row_stride, a.M, K, wbuf, nb, a.bias, a.y, a.N, n,
             [](int64_t) { return 1.0f; });
  }
}

}  // namespace

Int8LinearBlockFn VLLM_LITE_INT8_FN() { return &int8_linear_block; }
Int4LinearBlockFn VLLM_LITE_INT4_FN() { return &int4_linear_block; }

}  // namespace vllm_lite::cpu
