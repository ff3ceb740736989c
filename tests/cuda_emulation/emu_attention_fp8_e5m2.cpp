// Attention kernels reading an fp8 e5m2 cache on the emulator, for every query dtype.
#include "emu_attention_impl.h"

namespace emu_ops {
using vllm_lite::cuda::fp8_e5m2;
EMU_INSTANTIATE_ATTENTION(float, fp8_e5m2)
EMU_INSTANTIATE_ATTENTION(__half, fp8_e5m2)
EMU_INSTANTIATE_ATTENTION(__nv_bfloat16, fp8_e5m2)
}
