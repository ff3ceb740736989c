// Which attention kernel serves a call, the one place that decides: for decode
// (decode_path) between the SIMT kernel (attention_kernels.cuh: every dtype, cache format,
// group and head size, every GPU) and the tensor-core kernel (attention_tc_kernels.cuh);
// for varlen prefill (varlen_path) between varlen_attention_kernels.cuh and
// varlen_attention_tc_kernels.cuh. Plain C++: the CUDA launchers (paged_attention_v1.cu,
// varlen_attention.cu), the CPU emulator's replay of them (tests/cuda_emulation) and the
// tests of the choice all call these functions.
#pragma once

#include <cstdint>

namespace vllm_lite {
namespace cuda {
namespace attn {

enum class DecodePath : int { kSimt = 0, kTensorCore = 1 };

// compute_capability: major * 10 + minor (80 = A100, 90 = H100). The tensor-core kernel
// needs sm_80 (bf16 mma.m16n8k16, cp.async), 16-bit queries, a GQA/MQA group of at least 2
// query heads (one head fills 1 of the 16 rows of an MMA tile: the SIMT kernel's
// single-head loop is the better fit) and a head size of 64 or 128 (its register and
// shared-memory tiles are sized for exactly those). The cache does not enter the choice:
// both kernels read every cache element the launchers take (the query dtype, fp8 e4m3 and
// e5m2 with their scales) in both layouts (split and flash).
inline DecodePath decode_path(int compute_capability, bool query_is_16bit, int64_t group_size,
                              int64_t head_size) {
  const bool tc = compute_capability >= 80 && query_is_16bit && group_size >= 2 &&
                  (head_size == 64 || head_size == 128);
  return tc ? DecodePath::kTensorCore : DecodePath::kSimt;
}

// Which varlen_paged_attention (prefill) kernel serves a call: the SIMT kernel
// (varlen_attention_kernels.cuh: every dtype, cache format and head size, every GPU) or
// the tensor-core kernel (varlen_attention_tc_kernels.cuh). The tensor-core kernel needs
// sm_80, 16-bit queries with caches of the same dtype (fp8 caches stay on the SIMT kernel)
// and a head size of 64 or 128; it takes every group size (its 64-row M tile holds a
// block of query tokens times the group's heads, so even one head fills it) and both
// cache layouts.
enum class VarlenPath : int { kSimt = 0, kTensorCore = 1 };

inline VarlenPath varlen_path(int compute_capability, bool query_is_16bit,
                              bool cache_is_query_dtype, int64_t head_size) {
  const bool tc = compute_capability >= 80 && query_is_16bit && cache_is_query_dtype &&
                  (head_size == 64 || head_size == 128);
  return tc ? VarlenPath::kTensorCore : VarlenPath::kSimt;
}

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
