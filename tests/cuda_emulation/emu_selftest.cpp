// Small kernels that check the emulator itself: shuffle results, barriers, and that each
// class of bug it claims to catch is caught (test_emulator.py runs them).
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

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

// A 16-byte load from an address that is 4 bytes off.
__global__ void misaligned_kernel(const float* in, float* out) {
  const uint4 c = __ldg(reinterpret_cast<const uint4*>(in + 1));
  out[threadIdx.x] = __uint_as_float(c.x);
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
  } else if (name == "misaligned") {
    cuda_emu::launch(&misaligned_kernel, dim3(1), dim3(32), 0, "misaligned_kernel",
                     static_cast<const float*>(in), static_cast<float*>(out));
  } else {
    throw std::runtime_error("unknown selftest " + name);
  }
}

}  // namespace emu_ops
