// The tensor-core instructions of csrc/cuda/mma.cuh on the emulator, as the PTX ISA
// specifies them: each is a warp collective (emu_runtime.cpp) that gathers every lane's
// operands by the ISA's fragment layouts, computes the whole warp's result and hands each
// lane its fragment. See mma.cuh for the layouts.
//
// mma: D = A * B + C with the products and the sum in float64, rounded once to float32.
// The hardware's accumulation order and internal precision are unspecified; float64 is at
// least as accurate as any of them, so a kernel that passes here fails only by a wrong
// layout or a wrong operand, not by the accumulation.
// ldmatrix: every row address must be 16-byte aligned shared memory; the rows are read
// when the last lane arrives (all lanes' earlier stores are done by then).
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "emu_runtime.h"

namespace cuda_emu {
namespace {

[[noreturn]] void tensor_fail(const char* what, const char* where) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s (%s)", what, where);
  error(msg);
}

double elem(uint16_t bits, bool bf16) {
  return bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

uint16_t lo(uint32_t r) { return static_cast<uint16_t>(r & 0xffffu); }
uint16_t hi(uint32_t r) { return static_cast<uint16_t>(r >> 16); }

struct MmaLane {
  float* d;
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
  bool bf16;
  const char* where;
};

void mma_all(void* const* lanes) {
  double A[16][16], B[16][8], C[16][8];
  const bool bf16 = static_cast<const MmaLane*>(lanes[0])->bf16;
  for (int lane = 0; lane < 32; ++lane) {
    const MmaLane& L = *static_cast<const MmaLane*>(lanes[lane]);
    if (L.bf16 != bf16) tensor_fail("mma lanes disagree on the operand type", L.where);
    const int g = lane >> 2, t = lane % 4;
    // A: a[0] (g, 2t..), a[1] (g+8, 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..)
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i & 1) * 8;
      const int col = 2 * t + (i >> 1) * 8;
      A[row][col] = elem(lo(L.a[i]), bf16);
      A[row][col + 1] = elem(hi(L.a[i]), bf16);
    }
    // B: b[0] rows 2t, 2t+1 of column g; b[1] rows 2t+8, 2t+9.
    for (int i = 0; i < 2; ++i) {
      const int row = 2 * t + i * 8;
      B[row][g] = elem(lo(L.b[i]), bf16);
      B[row + 1][g] = elem(hi(L.b[i]), bf16);
    }
    // C: c[0], c[1] row g cols 2t, 2t+1; c[2], c[3] row g+8.
    for (int i = 0; i < 4; ++i) C[g + (i >> 1) * 8][2 * t + (i & 1)] = L.c[i];
  }
  float D[16][8];
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) {
      double acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
      D[m][n] = static_cast<float>(acc);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const MmaLane& L = *static_cast<const MmaLane*>(lanes[lane]);
    const int g = lane >> 2, t = lane % 4;
    for (int i = 0; i < 4; ++i) L.d[i] = D[g + (i >> 1) * 8][2 * t + (i & 1)];
  }
}

struct LdLane {
  uint32_t* r;
  const void* row;
  const char* where;
};

template <bool TRANS>
void ldmatrix_all(void* const* lanes) {
  uint16_t M[4][8][8];  // matrix, row, column
  for (int lane = 0; lane < 32; ++lane) {
    const LdLane& L = *static_cast<const LdLane*>(lanes[lane]);
    if (!is_shared(L.row, 16)) tensor_fail("ldmatrix row address is not shared memory", L.where);
    if (reinterpret_cast<uintptr_t>(L.row) % 16 != 0) {
      tensor_fail("ldmatrix row address is not 16-byte aligned", L.where);
    }
    memcpy(M[lane / 8][lane % 8], L.row, 16);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const LdLane& L = *static_cast<const LdLane*>(lanes[lane]);
    const int r = lane / 4, c = 2 * (lane % 4);
    for (int j = 0; j < 4; ++j) {
      const uint16_t e0 = TRANS ? M[j][c][r] : M[j][r][c];
      const uint16_t e1 = TRANS ? M[j][c + 1][r] : M[j][r][c + 1];
      L.r[j] = static_cast<uint32_t>(e0) | (static_cast<uint32_t>(e1) << 16);
    }
  }
}

}  // namespace

void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c, bool bf16,
                  const char* where) {
  MmaLane lane{d, a, b, c, bf16, where};
  // d may alias c: every lane's c is read before any d is written (mma_all).
  warp_collective(&lane, &mma_all, where);
}

void ldmatrix_x4(uint32_t* r, const void* row, bool trans, const char* where) {
  LdLane lane{r, row, where};
  warp_collective(&lane, trans ? &ldmatrix_all<true> : &ldmatrix_all<false>, where);
}

}  // namespace cuda_emu
