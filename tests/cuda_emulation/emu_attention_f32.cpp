// float32 instantiations of the attention kernels on the emulator; also defines the
// storage of the attention kernel's dynamic shared memory (`extern __shared__ float smem[]`).
#include "emu_attention_impl.h"

CUDA_EMU_DYNAMIC_SHARED(vllm_lite::cuda::attn, float, smem)

namespace emu_ops {
EMU_INSTANTIATE_ATTENTION(float, float)
}
