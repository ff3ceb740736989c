// The paged-attention limits, defined once for every part that depends on them: the
// argument checks (validate.cpp), the CPU kernels (cpu/attention.cpp, cpu/attention_kernel.h,
// cpu/attention_bf16dp.h), the CUDA kernels and their launchers (cuda/attention/). Where a
// fixed-size array is sized by one of them, the code static_asserts the relation, so
// changing a value here fails to compile instead of overrunning that array.
//
// Plain C++ with no includes: the per-ISA CPU kernel builds must not see torch, and the
// SIMT emulator (tests/cuda_emulation) compiles the CUDA kernels without it. Also shipped
// to C++ users as <vllm_lite/attention_limits.h> (included by <vllm_lite/ops.h>).
#pragma once

namespace vllm_lite {

// Tokens per partition of paged_attention_v2 (and the CPU kernels' task size; the CUDA
// kernel's online-softmax chunk). v2's scratch holds ceil(max_seq_len / kPartitionSize)
// partitions per (sequence, head).
constexpr int kPartitionSize = 512;

// Query heads per KV head (GQA / MQA group size) the kernels accept.
constexpr int kMaxQueryHeadsPerKvHead = 64;

// Largest head size; head sizes are multiples of 8 up to this.
constexpr int kMaxHeadSize = 256;

}  // namespace vllm_lite
