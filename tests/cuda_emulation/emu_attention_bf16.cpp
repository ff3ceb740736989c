// bfloat16 instantiations of the attention kernels on the emulator.
#include "emu_attention_impl.h"

namespace emu_ops {
EMU_INSTANTIATE_ATTENTION(__nv_bfloat16, __nv_bfloat16)
}
