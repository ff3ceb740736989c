// The definitions behind AttentionInstance / AttentionTcInstance / VarlenInstance /
// VarlenTcInstance: get() returns the kernel, so compiling get() compiles the kernel. Included only by the translation units that
// instantiate kernels: the files csrc/cuda/generate_kernels.py writes (each instance in
// exactly one of them) and the CPU emulator's (tests/cuda_emulation). The launchers see
// the declarations alone and call get() through the generated tables.
#pragma once

#include "attention_kernels.cuh"
#include "attention_tc_kernels.cuh"
#include "varlen_attention_kernels.cuh"
#include "varlen_attention_tc_kernels.cuh"

namespace vllm_lite {
namespace cuda {
namespace attn {

template <typename T, typename CT, int BLOCK_SIZE, int HEAD_MAX>
AttentionKernel AttentionInstance<T, CT, BLOCK_SIZE, HEAD_MAX>::get() {
  return &paged_attention_kernel<T, CT, BLOCK_SIZE, HEAD_MAX>;
}

template <typename T, typename CT, int BLOCK_SIZE, int HEAD>
AttentionKernel AttentionTcInstance<T, CT, BLOCK_SIZE, HEAD>::get() {
  return &paged_attention_tc_kernel<T, CT, BLOCK_SIZE, HEAD>;
}

}  // namespace attn

namespace varlen {

template <typename T, typename CT, int HEAD_MAX>
VarlenKernel VarlenInstance<T, CT, HEAD_MAX>::get() {
  return &varlen_paged_attention_kernel<T, CT, HEAD_MAX>;
}

template <typename T, typename CT, int HEAD>
VarlenKernel VarlenTcInstance<T, CT, HEAD>::get() {
  return &varlen_paged_attention_tc_kernel<T, CT, HEAD>;
}

}  // namespace varlen
}  // namespace cuda
}  // namespace vllm_lite
