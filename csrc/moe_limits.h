// The fused MoE op's limits, defined once for every part that depends on them: the
// argument checks (validate.cpp), the CPU kernel (cpu/fused_moe.cpp), the CUDA kernels
// (cuda/moe/), and Python (vllm_lite._C exports them; layers/moe.py's MAX_NUM_EXPERTS and
// MAX_TOP_K are these, which check_moe_config applies to a model's config at load).
//
// Plain C++ with no includes: the SIMT emulator (tests/cuda_emulation) compiles the CUDA
// kernels without torch.
#pragma once

namespace vllm_lite {

// Experts per layer (the largest released MoE checkpoints have 256). The CUDA routing
// kernel holds one token's probabilities in a warp's registers (this / 32 a lane) and the
// sort kernel's block has a thread per expert, so this stays a multiple of 32, at most
// 1024 (static_asserts in cuda/moe/fused_moe_kernels.cuh).
constexpr int kMoeMaxNumExperts = 512;

// Experts one token is routed to (each routing thread keeps its top-k in registers).
constexpr int kMoeMaxTopK = 32;

}  // namespace vllm_lite
