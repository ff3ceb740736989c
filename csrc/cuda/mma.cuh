// Tensor-core and asynchronous-copy instructions of sm_80 and newer, as small wrappers.
//
// Every kernel reaches these instructions only through the functions here, so the CPU
// emulator (tests/cuda_emulation) can give each one a body that computes what the PTX ISA
// specifies: on the GPU the body is the inline PTX; under the emulator
// (VLLM_LITE_CUDA_EMU) it is a warp collective (emu_tensor.cpp) with the ISA's fragment
// layouts, and cp.async copies land only at the cp.async.wait_group that completes them.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type";
// g = lane >> 2, t = lane % 4; a .b32 register holds two 16-bit elements, the lower
// column / row in its low half):
//   A (16 x 16, row-major)  a[0]: row g,     cols 2t, 2t+1      a[1]: row g+8, cols 2t, 2t+1
//                           a[2]: row g,     cols 2t+8, 2t+9    a[3]: row g+8, cols 2t+8, 2t+9
//   B (16 x 8, "col")       b[0]: rows 2t, 2t+1 of col g        b[1]: rows 2t+8, 2t+9 of col g
//   C / D (16 x 8, f32)     c[0], c[1]: row g, cols 2t, 2t+1    c[2], c[3]: row g+8, same cols
// ldmatrix.x4: lanes 8j .. 8j+7 give the shared addresses of rows 0..7 of 8 x 8 matrix j
// (16 bytes each); register j of lane i receives row i/4, cols 2(i%4), 2(i%4)+1 of matrix
// j (.trans: of its transpose, i.e. rows 2(i%4), 2(i%4)+1 of column i/4).
// The C fragment of two adjacent n8 tiles is the A fragment of one k16 step, which is how
// softmax probabilities feed the P.V product without going through shared memory.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace vllm_lite {
namespace cuda {
namespace tc {

// The instructions below exist from sm_80 (cp.async, bf16 mma.m16n8k16) on; device code
// compiled for older GPUs traps, and the launchers never pick these kernels there.
#if defined(VLLM_LITE_CUDA_EMU) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define VLLM_LITE_TC_AVAILABLE 1
#else
#define VLLM_LITE_TC_AVAILABLE 0
#endif

#if !defined(VLLM_LITE_CUDA_EMU)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// d = a * b + c (c and d may be the same array). T: __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma.m16n8k16 takes f16 or bf16 operands");
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::mma_m16n8k16(d, a, b, c, std::is_same_v<T, __nv_bfloat16>, CUDA_EMU_WHERE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory; row is this lane's row
// address (16-byte aligned).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::ldmatrix_x4(r, row, false, CUDA_EMU_WHERE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::ldmatrix_x4(r, row, true, CUDA_EMU_WHERE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 16 bytes global -> shared, asynchronously (cp.async.cg: through L2 only). With
// valid == false nothing is read and the 16 bytes are zero-filled (src-size 0); src must
// still be a mapped address for the GPU to accept the instruction, so pass a safe one.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid = true) {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::cp_async(dst, src, 16, valid ? 16 : 0, CUDA_EMU_WHERE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 8 bytes global -> shared, asynchronously (cp.async.ca: the only form for copies under
// 16 bytes), zero-filled with valid == false as cp_async_16.
__device__ __forceinline__ void cp_async_8(void* dst, const void* src, bool valid = true) {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::cp_async(dst, src, 8, valid ? 8 : 0, CUDA_EMU_WHERE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 8 : 0)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. The copies
// of other threads need a __syncthreads after their waits to be visible.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(VLLM_LITE_CUDA_EMU)
  ::cuda_emu::cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Two floats -> one register of two T (lo in the low half), rounded to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint16_t l, h;
  if constexpr (std::is_same_v<T, __half>) {
    const __half a = __float2half_rn(lo), b = __float2half_rn(hi);
    memcpy(&l, &a, 2);
    memcpy(&h, &b, 2);
  } else {
    const __nv_bfloat16 a = __float2bfloat16_rn(lo), b = __float2bfloat16_rn(hi);
    memcpy(&l, &a, 2);
    memcpy(&h, &b, 2);
  }
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

}  // namespace tc
}  // namespace cuda
}  // namespace vllm_lite
