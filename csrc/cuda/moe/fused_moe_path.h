// Which fused_moe GEMM kernels serve a call, the one place that decides, and the size of
// the tile table the tensor-core kernels read. Plain C++: the launcher (fused_moe.cu), the
// torch side that allocates its scratch (fused_moe_ops.cpp) and the CPU emulator's replay
// (tests/cuda_emulation/emu_moe.cpp) all call these.
#pragma once

#include <cstdint>

#include "cuda/launch_types.h"  // is_aligned16

namespace vllm_lite {
namespace cuda {
namespace moe {

enum class MoePath : int { kSimt = 0, kTensorCore = 1 };

// Rows of one tensor-core tile (one mma.m16n8k16 M); a tile's rows all belong to one
// expert, so an expert's grouped rows take ceil(rows / kMoeTcRows) tiles.
constexpr int kMoeTcRows = 16;
// Elements a lane loads at once (16 bytes of a 16-bit dtype): H and I must be multiples.
constexpr int kMoeTcChunk = 8;

// The most tiles P grouped rows over E experts can need: every expert with rows leaves at
// most one partial tile, and at most min(E, P) experts have rows.
inline int64_t moe_tc_max_tiles(int64_t pairs, int64_t experts) {
  return (pairs + kMoeTcRows - 1) / kMoeTcRows + (experts < pairs ? experts : pairs);
}

// Ints of the tile table: the tile count, then (expert, first grouped row, rows) per tile.
inline int64_t moe_tile_table_ints(int64_t pairs, int64_t experts) {
  return 1 + 3 * moe_tc_max_tiles(pairs, experts);
}

// compute_capability: major * 10 + minor. The tensor-core GEMMs need sm_80 (f16 / bf16
// mma.m16n8k16), a 16-bit dtype, H and I multiples of kMoeTcChunk and 16-byte aligned
// hidden / w13 / w2 (the lanes' 16-byte loads; every row start is then aligned too).
// float32, older GPUs and odd shapes take the SIMT kernels.
inline MoePath moe_path(int compute_capability, bool dtype_is_16bit, int64_t hidden,
                        int64_t intermediate, const void* hidden_states, const void* w13,
                        const void* w2) {
  const bool tc = compute_capability >= 80 && dtype_is_16bit && hidden % kMoeTcChunk == 0 &&
                  intermediate % kMoeTcChunk == 0 && is_aligned16(hidden_states) &&
                  is_aligned16(w13) && is_aligned16(w2);
  return tc ? MoePath::kTensorCore : MoePath::kSimt;
}

}  // namespace moe
}  // namespace cuda
}  // namespace vllm_lite
