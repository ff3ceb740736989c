// Small kernels that check the emulator itself: shuffle results, barriers, and that each
// class of bug it claims to catch is caught (test_emulator.py runs them).
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/mma.cuh"
#include "emu_runtime.h"

namespace selftest {

// out[tid * 4 + 0..3]: xor-butterfly sum over the warp, lane 3's value, shfl_down(1),
// shfl_up(2), of v = (lane + 1) * (warp + 1).
__global__ void shuffle_kernel(int* out) {
  const int tid = threadIdx.x;
  const int v = (tid % 32 + 1) * (tid / 32 + 1);
  int s = v;
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  out[tid * 4 + 0] = s;
  out[tid * 4 + 1] = __shfl_sync(0xffffffffu, v, 3);
  out[tid * 4 + 2] = __shfl_down_sync(0xffffffffu, v, 1);
  out[tid * 4 + 3] = __shfl_up_sync(0xffffffffu, v, 2);
}

// Each thread reads its neighbour's shared slot, with or without a barrier in between.
template <bool SYNC>
__global__ void neighbour_kernel(int* out) {
  __shared__ int s[128];
  const int tid = threadIdx.x;
  s[tid] = tid * 2;
  if (SYNC) __syncthreads();
  out[tid] = s[(tid + 1) % blockDim.x];
}

// Reads shared memory nobody wrote.
__global__ void uninit_kernel(unsigned* out) {
  __shared__ float s[64];
  float v = s[threadIdx.x];
  memcpy(&out[threadIdx.x], &v, 4);
}

// Half a warp shuffles while the other half waits at a barrier: a deadlock.
__global__ void deadlock_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// Threads exit before a barrier the others reach.
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 64) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Lanes of one warp shuffle with different masks.
__global__ void mask_mismatch_kernel(int* out) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<int>(threadIdx.x), 1);
}

// Reads dynamic shared memory past the launch's size (256 bytes).
__global__ void smem_oob_kernel(float* out) {
  extern __shared__ float dsm[];
  dsm[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = dsm[threadIdx.x + 64];
}

// Reads one element past the input buffer.
__global__ void global_oob_kernel(const float* in, float* out, int n) {
  out[threadIdx.x] = in[n + static_cast<int>(threadIdx.x)];
}

// Reads a thread's local array (registers on a GPU, the fiber's stack here) past its end,
// after a barrier switched the fiber out and back in with the array live: in[] holds
// 0, 1, 2, ..., so lanes 4 and up index past the 4 elements. Through a pointer whose
// origin UBSan cannot see (volatile): AddressSanitizer's stack redzones must catch it.
__global__ void local_oob_kernel(const float* in, float* out) {
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = static_cast<float>(threadIdx.x + i);
  __syncthreads();
  const float* volatile hidden = acc;
  const float* p = hidden;
  out[threadIdx.x] = p[static_cast<int>(in[threadIdx.x])];
}

// A 16-byte load from an address that is 4 bytes off.
__global__ void misaligned_kernel(const float* in, float* out) {
  const uint4 c = __ldg(reinterpret_cast<const uint4*>(in + 1));
  out[threadIdx.x] = __uint_as_float(c.x);
}

// ---- the tensor-core and async-copy wrappers of csrc/cuda/mma.cuh (one warp)

namespace tc = vllm_lite::cuda::tc;

// 32 rows of 8 16-bit values in shared memory (row r holds in[r * 8 ..]); lane l passes
// the address of row perm(l) = (l * 5 + 3) % 32, so a wrong row-to-lane mapping shows.
// out[lane * 4 + j] = register j.
template <bool TRANS>
__global__ void ldmatrix_kernel(const uint16_t* in, uint32_t* out) {
  __shared__ __align__(16) uint16_t rows[32 * 8];
  const int lane = threadIdx.x;
  for (int i = 0; i < 8; ++i) rows[lane * 8 + i] = in[lane * 8 + i];
  __syncwarp();
  uint32_t r[4];
  const uint16_t* row = rows + ((lane * 5 + 3) % 32) * 8;
  if (TRANS) {
    tc::ldmatrix_x4_trans(r, row);
  } else {
    tc::ldmatrix_x4(r, row);
  }
  for (int j = 0; j < 4; ++j) out[lane * 4 + j] = r[j];
}

// D = A * B + C for one m16n8k16 tile: A [16][16] row-major, B [16][8] row-major (k, n),
// C [16][8] floats, D [16][8] floats. A comes through ldmatrix_x4; B through
// ldmatrix_x4_trans of B as stored (B_MODE 0) or ldmatrix_x4 of its transpose (B_MODE 1),
// so the test covers both forms against one reference. D is written by the accumulator
// layout of the ISA.
template <typename T, int B_MODE>
__global__ void mma_kernel(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  __shared__ __align__(16) uint16_t as[16 * 16];
  __shared__ __align__(16) uint16_t bs[16 * 8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) as[i] = a[i];
  for (int i = lane; i < 128; i += 32) {
    const int k = i / 8, n = i % 8;
    if (B_MODE == 0) {
      bs[i] = b[i];
    } else {
      bs[n * 16 + k] = b[i];
    }
  }
  __syncwarp();
  uint32_t af[4], bf[4];
  // matrices: 0 rows 0-7 cols 0-7, 1 rows 8-15 cols 0-7, 2 rows 0-7 cols 8-15, 3 rows
  // 8-15 cols 8-15 (the order of the A fragment's registers).
  const int m = lane / 8, r = lane % 8;
  tc::ldmatrix_x4(af, as + ((m & 1) * 8 + r) * 16 + (m >> 1) * 8);
  if (B_MODE == 0) {  // rows k of B (8 values each): matrices k 0-7, k 8-15 (twice)
    tc::ldmatrix_x4_trans(bf, bs + ((m & 1) * 8 + r) * 8);
  } else {  // rows n of B^T: matrices (n, k 0-7), (n, k 8-15) (twice)
    tc::ldmatrix_x4(bf, bs + r * 16 + (m & 1) * 8);
  }
  const uint32_t bb[2] = {bf[0], bf[1]};
  const int g = lane >> 2, t = lane % 4;
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                  c[(g + 8) * 8 + 2 * t + 1]};
  tc::mma_m16n8k16<T>(acc, af, bb, acc);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// cp.async group accounting: thread i copies in[i] (16 bytes, group 0) and in[32 + i]
// (group 1), or zero-fills (src-size 0) for odd i in group 1. out[phase][slot][i] records
// shared memory: phase 0 before any wait, 1 after wait_group 1, 2 after wait_group 0.
__global__ void cp_async_kernel(const uint4* in, uint4* out) {
  __shared__ uint4 s[2][32];
  const int i = threadIdx.x;
  tc::cp_async_16(&s[0][i], &in[i]);
  tc::cp_async_commit();
  tc::cp_async_16(&s[1][i], &in[32 + i], i % 2 == 0);
  tc::cp_async_commit();
  out[0 * 64 + i] = s[0][i];
  out[0 * 64 + 32 + i] = s[1][i];
  tc::cp_async_wait<1>();
  out[1 * 64 + i] = s[0][i];
  out[1 * 64 + 32 + i] = s[1][i];
  tc::cp_async_wait<0>();
  out[2 * 64 + i] = s[0][i];
  out[2 * 64 + 32 + i] = s[1][i];
}

// A copy that no wait completes before the thread exits.
__global__ void cp_async_unwaited_kernel(const uint4* in, uint4* out) {
  __shared__ uint4 s[32];
  tc::cp_async_16(&s[threadIdx.x], &in[threadIdx.x]);
  tc::cp_async_commit();
  out[threadIdx.x] = in[threadIdx.x];
}

// cp.async into global memory (not shared): an error.
__global__ void cp_async_global_dst_kernel(const uint4* in, uint4* out) {
  tc::cp_async_16(&out[threadIdx.x], &in[threadIdx.x]);
  tc::cp_async_commit();
  tc::cp_async_wait<0>();
}

}  // namespace selftest

CUDA_EMU_DYNAMIC_SHARED(selftest, float, dsm)

namespace emu_ops {

// Runs self-test `name` with the given buffers (see test_emulator.py for each one's
// expected outcome).
void run_selftest(const std::string& name, void* in, int64_t in_bytes, void* out) {
  using namespace selftest;
  auto* oi = static_cast<int*>(out);
  if (name == "shuffle") {
    cuda_emu::launch(&shuffle_kernel, dim3(1), dim3(64), 0, "shuffle_kernel", oi);
  } else if (name == "barrier") {
    cuda_emu::launch(&neighbour_kernel<true>, dim3(1), dim3(128), 0, "neighbour<sync>", oi);
  } else if (name == "missing_barrier") {
    cuda_emu::launch(&neighbour_kernel<false>, dim3(1), dim3(128), 0, "neighbour<nosync>", oi);
  } else if (name == "uninit_shared") {
    cuda_emu::launch(&uninit_kernel, dim3(1), dim3(64), 0, "uninit_kernel",
                     static_cast<unsigned*>(out));
  } else if (name == "deadlock") {
    cuda_emu::launch(&deadlock_kernel, dim3(1), dim3(32), 0, "deadlock_kernel", oi);
  } else if (name == "divergent_barrier") {
    cuda_emu::launch(&divergent_barrier_kernel, dim3(1), dim3(128), 0, "divergent_barrier", oi);
  } else if (name == "mask_mismatch") {
    cuda_emu::launch(&mask_mismatch_kernel, dim3(1), dim3(32), 0, "mask_mismatch", oi);
  } else if (name == "smem_oob") {
    cuda_emu::launch(&smem_oob_kernel, dim3(1), dim3(64), 256, "smem_oob_kernel",
                     static_cast<float*>(out));
  } else if (name == "global_oob") {
    cuda_emu::launch(&global_oob_kernel, dim3(1), dim3(32), 0, "global_oob_kernel",
                     static_cast<const float*>(in), static_cast<float*>(out),
                     static_cast<int>(in_bytes / 4) - 31);
  } else if (name == "local_oob") {
    cuda_emu::launch(&local_oob_kernel, dim3(1), dim3(32), 0, "local_oob_kernel",
                     static_cast<const float*>(in), static_cast<float*>(out));
  } else if (name == "misaligned") {
    cuda_emu::launch(&misaligned_kernel, dim3(1), dim3(32), 0, "misaligned_kernel",
                     static_cast<const float*>(in), static_cast<float*>(out));
  } else if (name == "ldmatrix" || name == "ldmatrix_trans") {
    auto kernel = name == "ldmatrix" ? &ldmatrix_kernel<false> : &ldmatrix_kernel<true>;
    cuda_emu::launch(kernel, dim3(1), dim3(32), 0, name.c_str(),
                     static_cast<const uint16_t*>(in), static_cast<uint32_t*>(out));
  } else if (name.rfind("mma_", 0) == 0) {
    // in: A (256 x 16 bits), B (128 x 16 bits), C (128 floats); out: D (128 floats)
    const auto* a = static_cast<const uint16_t*>(in);
    const auto* b = a + 256;
    const auto* c = reinterpret_cast<const float*>(b + 128);
    auto* d = static_cast<float*>(out);
    using K = void (*)(const uint16_t*, const uint16_t*, const float*, float*);
    K k = name == "mma_f16_0"    ? &mma_kernel<__half, 0>
          : name == "mma_f16_1"  ? &mma_kernel<__half, 1>
          : name == "mma_bf16_0" ? &mma_kernel<__nv_bfloat16, 0>
          : name == "mma_bf16_1" ? &mma_kernel<__nv_bfloat16, 1>
                                 : nullptr;
    if (k == nullptr) throw std::runtime_error("unknown selftest " + name);
    cuda_emu::launch(k, dim3(1), dim3(32), 0, name.c_str(), a, b, c, d);
  } else if (name == "cp_async" || name == "cp_async_unwaited" || name == "cp_async_global_dst") {
    auto k = name == "cp_async"            ? &cp_async_kernel
             : name == "cp_async_unwaited" ? &cp_async_unwaited_kernel
                                           : &cp_async_global_dst_kernel;
    cuda_emu::launch(k, dim3(1), dim3(32), 0, name.c_str(), static_cast<const uint4*>(in),
                     static_cast<uint4*>(out));
  } else {
    throw std::runtime_error("unknown selftest " + name);
  }
}

}  // namespace emu_ops
