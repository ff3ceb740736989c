// CUDA kernels of the element-wise ops of a decoder layer (elementwise.cu): rms_norm,
// fused_add_rms_norm, silu_and_mul, rotary_embedding, plus the host-side launch plans
// (vector path or not, threads, grid) that elementwise.cu and the CPU emulation
// (tests/cuda_emulation/emu_elementwise.cpp) both use, so the emulator runs exactly this
// code with the launcher's choices.
//
// Semantics (csrc/ops.h): T = float, half or bfloat16; all math in float32; round_T(v) =
// v rounded to T, nearest even (float -> T -> float; the identity for float32), placed
// where Hugging Face's Llama rounds. Every product that the contract rounds on its own
// (rotary's a*c, b*s; silu's h*h) is __fmul_rn: nvcc (--fmad=true, the default) would
// otherwise fuse it with the following add / sub into one FMA, and in float32, where
// round_T is the identity, that changes the last bit. The other math (sum of squares,
// the exp polynomial) is explicit fmaf or order-free. Division and rsqrt are the IEEE
// round-to-nearest intrinsics (__fdiv_rn, __frsqrt_rn): the build uses --use_fast_math,
// under which `/` and rsqrtf are approximations; each runs once per row or element of a
// memory-bound kernel, so the exact ones cost nothing measurable, and the GPU and the
// emulator then compute the same bits (up to the GPU's flush of float32 subnormals).
//
// Layouts (every pointer is the first element of its view):
//   rms_norm            input rows r at input + r * row_stride (last dim contiguous), hidden
//                       elements; out [rows, hidden] contiguous; weight [hidden].
//   fused_add_rms_norm  input, residual [rows, hidden] contiguous; weight [hidden].
//   silu_and_mul        input rows at input + r * row_stride: [gate d | up d]; out [rows, d]
//                       contiguous.
//   rotary_embedding    positions int64 [num_tokens]; query token t at query + t * q_stride,
//                       num_heads heads of head_size contiguous; key likewise (k_stride,
//                       num_kv_heads); cos_sin_cache [max_position, rot_dim] contiguous
//                       (float32 or T): [cos | sin] halves of rot_dim / 2.
//
// Kernels:
//   rms_norm_kernel<T, VEC>, fused_add_rms_norm_kernel<T, VEC>
//     Grid   x = rows (one CTA per row).
//     Block  plan_norm: one thread per 16-byte chunk (VEC) or element of the row, rounded
//            up to a warp, between 32 and kMaxNormThreads = 1024; wider rows loop.
//     Work   pass 1: sum of squares (fused: r = round_T(input + residual) stored to
//            residual, squares of the rounded r), block reduction (warp shuffles, then 32
//            floats of shared memory); inv = rsqrt(sum / hidden + eps); pass 2 re-reads the
//            row (L1/L2 hits; the fused pass 2 reads what the same thread stored in pass 1)
//            and writes round_T(w * round_T(x * inv)).
//     VEC    16-byte loads/stores (4 floats, 8 half / bfloat16) when hidden and the row
//            stride are multiples of a chunk and every pointer is 16-byte aligned; else
//            element-wise (any hidden, any alignment).
//   silu_and_mul_kernel<T, VEC>
//     Grid   x = rows, y = ceil(units / threads) capped at kMaxGridY (65535; the CTAs then
//            loop), units = d / 8 (4 for float) chunks (VEC) or d elements.
//     Block  kSiluThreads = 256 (fewer for short rows, at least a warp); one unit per
//            thread per step. VEC as above (d, the row stride, out and input aligned).
//     silu(x) = x / (1 + exp(-x)) through h = exp(-|x| / 2) (see silu_f32): within 4
//            float32 ulps of float64 wherever the result is a normal float (measured over
//            4M points of [-100, 100]), without __expf's error growing with |x|
//            (--use_fast_math maps expf to __expf).
//   rotary_embedding_kernel<T, CT, NEOX>
//     Grid   x = num_tokens (one CTA per token).
//     Block  one thread per rotated pair of all the token's heads ((num_heads +
//            num_kv_heads) * rot_dim / 2), rounded up to a warp, between 32 and
//            kMaxRotaryThreads = 512; more pairs loop. Element-wise loads and stores (q and k
//            are usually column slices of a fused qkv row, so alignment is not given).
//     Positions are clamped into [0, max_position): an unvalidated position (the value
//            check runs only with VLLM_LITE_CHECK_VALUES=1) rotates by some table row but
//            never reads outside the table. The launcher skips an empty table.
// Limits: rows, num_tokens <= INT_MAX (one grid dimension); hidden, d, the pair count and
//   head offsets < 2^31 (checked by the launchers); no shared-memory or register arrays that
//   grow with the sizes.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/dtype.cuh"
#include "cuda/warp.cuh"

namespace vllm_lite {
namespace cuda {
namespace ew {

constexpr int kMaxNormThreads = 1024;
constexpr int kSiluThreads = 256;
constexpr int kMaxRotaryThreads = 512;
constexpr int kMaxGridY = 65535;

// round_T of a float32 value: float -> T -> float (nearest even), the identity for float.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return to_float(from_float<T>(v));
  }
}

// One 16-byte chunk of T at p (16-byte aligned) as kChunkElems<T> floats. A plain load, not
// __ldg: fused_add_rms_norm reads rows it writes, and rms_norm's out may be its input.
template <typename T>
__device__ __forceinline__ void load_chunk_f(const T* p, float* f) {
  chunk_to_float<T>(*reinterpret_cast<const uint4*>(p), f);
}

// kChunkElems<T> floats -> T (nearest even) -> one 16-byte store at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store_chunk_f(T* p, const float* f) {
  constexpr int N = kChunkElems<T>;
  T v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = from_float<T>(f[i]);
  uint4 c;
  memcpy(&c, v, sizeof(c));
  *reinterpret_cast<uint4*>(p) = c;
}

// Sum of v over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// Call once per kernel (the shared words are not reset for a second use).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// 1 / sqrt(mean of squares + eps) of a row, HF's order: variance = sum / hidden in float32,
// then rsqrt(variance + eps). Both steps correctly rounded (see the file comment).
__device__ __forceinline__ float inv_rms(float sum_sq, int hidden, float eps) {
  return __frsqrt_rn(__fdiv_rn(sum_sq, static_cast<float>(hidden)) + eps);
}

// round_T(w * round_T(x * inv)): HF multiplies the float32 hidden state by rsqrt, casts it
// to the weight's dtype, then multiplies by the weight in that dtype.
template <typename T>
__device__ __forceinline__ float norm_out(float x, float w, float inv) {
  return __fmul_rn(w, round_to<T>(__fmul_rn(x, inv)));
}

// out and input are not __restrict__: out == input (in place) is a valid call, and a
// restrict-qualified const input would let nvcc read it through the non-coherent cache.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kMaxNormThreads)
    rms_norm_kernel(T* out, const T* input, const T* __restrict__ weight, int64_t row_stride,
                    int hidden, float eps) {
  const int64_t row = blockIdx.x;
  const T* x = input + row * row_stride;
  T* y = out + row * hidden;
  float ss = 0.0f;
  if constexpr (VEC) {
    constexpr int N = kChunkElems<T>;
    const int chunks = hidden / N;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[N];
      load_chunk_f(x + c * N, f);
#pragma unroll
      for (int i = 0; i < N; ++i) ss = fmaf(f[i], f[i], ss);
    }
    const float inv = inv_rms(block_sum(ss), hidden, eps);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[N], w[N];
      load_chunk_f(x + c * N, f);
      chunk_to_float<T>(load_chunk(weight + c * N), w);
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = norm_out<T>(f[i], w[i], inv);
      store_chunk_f(y + c * N, f);
    }
  } else {
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
      const float v = to_float(x[e]);
      ss = fmaf(v, v, ss);
    }
    const float inv = inv_rms(block_sum(ss), hidden, eps);
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
      y[e] = from_float<T>(norm_out<T>(to_float(x[e]), to_float(__ldg(weight + e)), inv));
    }
  }
}

// Pass 2 reads residual where the same thread stored it in pass 1 (same index mapping), so
// program order makes the stores visible; block_sum's barriers sit between the passes.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kMaxNormThreads)
    fused_add_rms_norm_kernel(T* __restrict__ input, T* __restrict__ residual,
                              const T* __restrict__ weight, int hidden, float eps) {
  const int64_t row = blockIdx.x;
  T* x = input + row * hidden;
  T* r = residual + row * hidden;
  float ss = 0.0f;
  if constexpr (VEC) {
    constexpr int N = kChunkElems<T>;
    const int chunks = hidden / N;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float a[N], b[N];
      load_chunk_f(x + c * N, a);
      load_chunk_f(r + c * N, b);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        a[i] = round_to<T>(a[i] + b[i]);  // HF: residual = hidden + residual, in T
        ss = fmaf(a[i], a[i], ss);        // the variance of the rounded sum
      }
      store_chunk_f(r + c * N, a);
    }
    const float inv = inv_rms(block_sum(ss), hidden, eps);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[N], w[N];
      load_chunk_f(r + c * N, f);
      chunk_to_float<T>(load_chunk(weight + c * N), w);
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = norm_out<T>(f[i], w[i], inv);
      store_chunk_f(x + c * N, f);
    }
  } else {
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
      const T s = from_float<T>(to_float(x[e]) + to_float(r[e]));
      r[e] = s;
      const float v = to_float(s);
      ss = fmaf(v, v, ss);
    }
    const float inv = inv_rms(block_sum(ss), hidden, eps);
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
      x[e] = from_float<T>(norm_out<T>(to_float(r[e]), to_float(__ldg(weight + e)), inv));
    }
  }
}

// exp(t) for t in [-87, 0] (normal results): t = k ln2 + r, |r| <= ln2 / 2 (Cody-Waite with
// a two-part ln2, exact enough through fmaf), exp(r) by its degree-7 Taylor polynomial
// (truncation < 0.1 float32 ulp on that interval), times 2^k built in the exponent bits.
// Within 1 ulp (0.93 at most over 4M points of [-87, 0], against float64); only fmaf /
// rintf / bit operations, so the GPU and the emulator agree bit for bit.
__device__ __forceinline__ float exp_nonpositive_f32(float t) {
  const float k = rintf(t * 1.44269504088896341f);
  float r = fmaf(k, -0.693145751953125f, t);  // ln2's high part: 16 significant bits
  r = fmaf(k, -1.42860682030941723e-06f, r);  // ln2 - high part
  float p = 1.0f / 5040.0f;
  p = fmaf(p, r, 1.0f / 720.0f);
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int e = static_cast<int>(k) + 127;  // k in [-126, 0]: a normal power of two
  return __fmul_rn(p, __int_as_float(e << 23));
}

// silu(x) = x / (1 + exp(-x)) in float32. With h = exp(-|x| / 2) (never overflows) and
// e = h * h = exp(-|x|): x >= 0: x / (1 + e); x < 0: exp(-x) = 1 / e, so x * e / (1 + e),
// computed as (x * h) * h so that x * e stays a normal float down to x ~ -100 (e alone
// would be subnormal from x < -87, which the GPU flushes to zero). Below -|x| / 2 = -87, h
// is 0: x >= 0 gives x, x < 0 gives -0 (the true value is below float32's range), x = -inf
// gives NaN as torch's silu does, and NaN stays NaN.
__device__ __forceinline__ float silu_f32(float x) {
  const float t = -0.5f * fabsf(x);
  const float h = t >= -87.0f ? exp_nonpositive_f32(t) : 0.0f;
  const float den = 1.0f + __fmul_rn(h, h);
  const float num = x >= 0.0f ? x : __fmul_rn(__fmul_rn(x, h), h);
  return __fdiv_rn(num, den);
}

template <typename T, bool VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input,
                                    int64_t row_stride, int d) {
  const int64_t row = blockIdx.x;
  const T* g = input + row * row_stride;
  const T* u = g + d;
  T* o = out + row * d;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  if constexpr (VEC) {
    constexpr int N = kChunkElems<T>;
    const int64_t chunks = d / N;
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < chunks;
         c += step) {
      float a[N], b[N];
      chunk_to_float<T>(load_chunk(g + c * N), a);
      chunk_to_float<T>(load_chunk(u + c * N), b);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] = __fmul_rn(round_to<T>(silu_f32(a[i])), b[i]);
      store_chunk_f(o + c * N, a);
    }
  } else {
    for (int64_t e = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; e < d;
         e += step) {
      const float a = round_to<T>(silu_f32(to_float(__ldg(g + e))));
      o[e] = from_float<T>(__fmul_rn(a, to_float(__ldg(u + e))));
    }
  }
}

struct RotaryParams {
  int64_t q_stride;      // elements between tokens of query
  int64_t k_stride;      // and of key
  int64_t max_position;  // rows of the table (> 0)
  int num_heads;
  int num_kv_heads;
  int head_size;
  int rot_dim;
};

// T: query / key dtype; CT: the table's (float or T). Each thread rotates pairs
// w = head * (rot_dim / 2) + i, heads [0, num_heads) of query, then num_kv_heads of key.
template <typename T, typename CT, bool NEOX>
__global__ void rotary_embedding_kernel(const int64_t* __restrict__ positions,
                                        T* __restrict__ query, T* __restrict__ key,
                                        const CT* __restrict__ cos_sin_cache,
                                        const RotaryParams p) {
  const int64_t token = blockIdx.x;
  int64_t pos = positions[token];
  pos = pos < 0 ? 0 : (pos >= p.max_position ? p.max_position - 1 : pos);
  const int half = p.rot_dim / 2;
  const CT* cos_row = cos_sin_cache + pos * p.rot_dim;
  const CT* sin_row = cos_row + half;
  const int pairs = (p.num_heads + p.num_kv_heads) * half;
  T* q = query + token * p.q_stride;
  T* k = key + token * p.k_stride;
  for (int w = threadIdx.x; w < pairs; w += blockDim.x) {
    const int head = w / half;
    const int i = w - head * half;
    T* x = head < p.num_heads
               ? q + static_cast<int64_t>(head) * p.head_size
               : k + static_cast<int64_t>(head - p.num_heads) * p.head_size;
    // HF casts the float32 table to the activations' dtype before multiplying.
    const float c = round_to<T>(to_float(__ldg(cos_row + i)));
    const float s = round_to<T>(to_float(__ldg(sin_row + i)));
    const int ia = NEOX ? i : 2 * i;
    const int ib = NEOX ? i + half : 2 * i + 1;
    const float a = to_float(x[ia]);
    const float b = to_float(x[ib]);
    // x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
    x[ia] = from_float<T>(round_to<T>(__fmul_rn(a, c)) - round_to<T>(__fmul_rn(b, s)));
    x[ib] = from_float<T>(round_to<T>(__fmul_rn(b, c)) + round_to<T>(__fmul_rn(a, s)));
  }
}

// ---- host-side launch plans (shared with tests/cuda_emulation/emu_elementwise.cpp)

// Threads of a CTA for `work` items: rounded up to a warp, within [32, max_threads].
inline int threads_for(int64_t work, int max_threads) {
  const int64_t t = (work + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > max_threads ? max_threads : t));
}

struct NormPlan {
  bool vec;     // 16-byte chunks
  int threads;  // per CTA (one CTA per row)
};

// rms_norm (row_stride: input's) and fused_add_rms_norm (row_stride = hidden). esize: bytes
// per element. ptrs: every row-0 pointer the kernel reads or writes (out, input, weight /
// input, residual, weight).
inline NormPlan plan_norm(int64_t hidden, int64_t row_stride, int64_t esize,
                          const void* p0, const void* p1, const void* p2) {
  const int64_t n = 16 / esize;
  NormPlan plan{};
  plan.vec = hidden % n == 0 && row_stride % n == 0 && is_aligned16(p0) && is_aligned16(p1) &&
             is_aligned16(p2);
  plan.threads = threads_for(plan.vec ? hidden / n : hidden, kMaxNormThreads);
  return plan;
}

struct SiluPlan {
  bool vec;
  int threads;
  int grid_y;  // CTAs per row
};

inline SiluPlan plan_silu_and_mul(int64_t d, int64_t row_stride, int64_t esize,
                                  const void* out, const void* input) {
  const int64_t n = 16 / esize;
  SiluPlan plan{};
  plan.vec = d % n == 0 && row_stride % n == 0 && is_aligned16(out) && is_aligned16(input);
  const int64_t units = plan.vec ? d / n : d;
  plan.threads = threads_for(units, kSiluThreads);
  const int64_t ctas = (units + plan.threads - 1) / plan.threads;
  plan.grid_y = static_cast<int>(ctas < 1 ? 1 : (ctas > kMaxGridY ? kMaxGridY : ctas));
  return plan;
}

inline int rotary_threads(int64_t num_heads, int64_t num_kv_heads, int64_t rot_dim) {
  return threads_for((num_heads + num_kv_heads) * (rot_dim / 2), kMaxRotaryThreads);
}

}  // namespace ew
}  // namespace cuda
}  // namespace vllm_lite
