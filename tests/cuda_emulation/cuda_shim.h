// Host C++ definitions of the CUDA names the kernels in csrc/cuda use, so the unmodified
// kernel templates compile with g++ and run on the CPU under the SIMT emulator
// (emu_runtime.h). Included through the stand-in headers in fake_include/ (cuda_fp16.h,
// cuda_bf16.h, c10/...), which the kernel headers include first.
//
// What maps to what:
//   __global__ / __device__ / __host__ / __launch_bounds__ / __grid_constant__: vanish.
//   __shared__ -> thread_local. A block runs all of its threads as fibers on one worker
//     thread, so a thread_local is shared by exactly the threads of the block running
//     there; the runtime fills every such variable with a NaN pattern at block start
//     (uninitialised shared memory). `extern __shared__ T name[]` (dynamic shared memory)
//     refers to a namespace-scope array the emulation TU defines with
//     CUDA_EMU_DYNAMIC_SHARED (48 KiB, CUDA's default limit); the part past the launch's
//     dynamic size is ASan-poisoned, so reading beyond it fails like on a GPU.
//   threadIdx / blockIdx / blockDim / gridDim: the running fiber's / block's values.
//   __syncthreads, __syncwarp, __shfl_*_sync: real barriers / warp exchanges between the
//     fibers (emu_runtime.cpp), with divergence and deadlock detection.
//   atomicAdd (integers): an atomic add, landing in the order the schedule runs the fibers.
//   half / bfloat16: 16-bit structs without implicit conversions (as torch compiles CUDA,
//     __CUDA_NO_HALF_CONVERSIONS__), converted bit-exactly like CUDA (round to nearest
//     even; NaN -> 0x7fff).
//   uint4 / float4 / float2: 16- / 16- / 8-byte aligned, so UBSan's alignment check fails a
//     misaligned vector load the way a GPU faults on it.
#pragma once

// Kernel headers that need an emulator body instead of inline PTX (cuda/mma.cuh) test it.
#define VLLM_LITE_CUDA_EMU 1

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local

// ---- vector types
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

using cudaStream_t = struct CUstream_st*;
// The launchers' return type (csrc/cuda/*_launch.h declare them; the emulator replays the
// launches itself and never calls those).
enum cudaError_t { cudaSuccess = 0 };

// ---- math and bit casts
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int __float_as_int(float f) { return static_cast<int>(__float_as_uint(f)); }
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned>(i)); }
// CUDA's __expf is an approximation (ex2.approx); expf is within its error bound, and the
// tests' tolerances are the real GPU's.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// IEEE float32 division, round to nearest even (on the GPU also under --use_fast_math).
inline float __fdiv_rn(float a, float b) { return a / b; }

// CUDA's device min/max overloads (same-type arguments, as the kernels use them).
#define CUDA_EMU_MINMAX(T)                               \
  inline T min(T a, T b) { return b < a ? b : a; }       \
  inline T max(T a, T b) { return a < b ? b : a; }
CUDA_EMU_MINMAX(int)
CUDA_EMU_MINMAX(unsigned)
CUDA_EMU_MINMAX(long)
CUDA_EMU_MINMAX(unsigned long)
CUDA_EMU_MINMAX(long long)
CUDA_EMU_MINMAX(unsigned long long)
#undef CUDA_EMU_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
using std::fmaxf;
using std::fminf;

// Read-only-cache load: a plain load (UBSan checks T's alignment).
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// atomicAdd on integers (shared or global memory): returns the old value. A block's fibers
// switch only at barriers and warp exchanges, so among them any read-modify-write is
// atomic; blocks on other worker threads share global memory, hence a real atomic. The
// fibers' order between barriers follows the schedule seed, and with it the order in
// which the adds land.
template <typename T>
inline T atomicAdd(T* address, T value) {
  static_assert(std::is_integral_v<T>, "the emulator's atomicAdd takes integers");
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}

// ---- half and bfloat16
struct __half {
  unsigned short __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  unsigned short __x;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
using half = __half;
using half2 = __half2;

namespace cuda_emu {

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, exact in float
    const float f = static_cast<float>(man) * 0x1p-24f;
    return sign ? -f : f;
  }
  return __uint_as_float(bits);
}

// Round to nearest even, overflow to infinity, NaN -> 0x7fff (CUDA's canonical NaN).
inline uint16_t float_to_half_bits_rn(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 (or inf)
  if (ax >= 0x38800000u) {  // normal half: rebias, round 23 -> 10 mantissa bits
    const uint32_t r = ax - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 (ties to 0)
  // Subnormal half: value / 2^-24 = m * 2^(e - 126), rounded to nearest even.
  const uint32_t e = ax >> 23;
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

inline float bf16_bits_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16_bits_rn(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace cuda_emu

inline float __half2float(__half h) { return cuda_emu::half_bits_to_float(h.__x); }
inline __half __float2half_rn(float f) { return __half{cuda_emu::float_to_half_bits_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a), __float2half_rn(b)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return cuda_emu::bf16_bits_to_float(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{cuda_emu::float_to_bf16_bits_rn(f)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return {__bfloat162float(b.x), __bfloat162float(b.y)};
}

// ---- thread indices, barriers, warp exchanges (emu_runtime.cpp)
namespace cuda_emu {

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void syncthreads(const char* where);
void syncwarp(unsigned mask, const char* where);
// One warp-level exchange: every lane of `mask` deposits `value`; returns the value of
// lane src_of(lane) once all of them have arrived. kind: 0 idx, 1 xor, 2 up, 3 down.
uint64_t shfl(unsigned mask, uint64_t value, int kind, int arg, int width, const char* where);

// A warp collective (the tensor-core and ldmatrix instructions, emu_tensor.cpp): all 32
// lanes of the warp arrive with their operands (lane_data); when the last one arrives,
// fn(lanes) runs once with the 32 lanes' lane_data, lane order, and computes every lane's
// result. Lanes meeting at different instructions (fn) -> error.
using WarpCollectiveFn = void (*)(void* const* lanes);
void warp_collective(void* lane_data, WarpCollectiveFn fn, const char* where);
// Whether [p, p + bytes) lies in the calling block's shared memory.
bool is_shared(const void* p, size_t bytes);
int lane_id();
// Fails the run with msg, naming the kernel, block and thread (an emulator error).
[[noreturn]] void error(const char* msg);
// cp.async (emu_runtime.cpp): the copy of `bytes` bytes (src_bytes of them read from src,
// the rest zero-filled) is recorded at issue and performed by the first cp_async_wait
// that completes its group; until then the destination keeps what it held (the NaN
// poison, or an older tile), as on a GPU where nothing orders the copy before the wait.
void cp_async(void* dst_shared, const void* src, int bytes, int src_bytes, const char* where);
void cp_async_commit();
void cp_async_wait(int pending);
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d = a * b + c over the warp
// (emu_tensor.cpp); ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16.
void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c, bool bf16,
                  const char* where);
void ldmatrix_x4(uint32_t* r, const void* row, bool trans, const char* where);

template <typename T>
inline T shfl_typed(unsigned mask, T v, int kind, int arg, int width, const char* where) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shfl(mask, bits, kind, arg, width, where);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

}  // namespace cuda_emu

#define CUDA_EMU_STR2(x) #x
#define CUDA_EMU_STR(x) CUDA_EMU_STR2(x)
#define CUDA_EMU_WHERE __FILE__ ":" CUDA_EMU_STR(__LINE__)

#define threadIdx (::cuda_emu::thread_idx())
#define blockIdx (::cuda_emu::block_idx())
#define blockDim (::cuda_emu::block_dim())
#define gridDim (::cuda_emu::grid_dim())
#define warpSize 32
#define __syncthreads() ::cuda_emu::syncthreads(CUDA_EMU_WHERE)
#define __syncwarp(...) ::cuda_emu::syncwarp(__VA_ARGS__ + 0 ? (__VA_ARGS__ + 0) : 0xffffffffu, CUDA_EMU_WHERE)
#define __shfl_sync(mask, v, src, ...) \
  ::cuda_emu::shfl_typed(mask, v, 0, src, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, CUDA_EMU_WHERE)
#define __shfl_xor_sync(mask, v, lm, ...) \
  ::cuda_emu::shfl_typed(mask, v, 1, lm, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, CUDA_EMU_WHERE)
#define __shfl_up_sync(mask, v, d, ...) \
  ::cuda_emu::shfl_typed(mask, v, 2, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, CUDA_EMU_WHERE)
#define __shfl_down_sync(mask, v, d, ...) \
  ::cuda_emu::shfl_typed(mask, v, 3, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, CUDA_EMU_WHERE)
