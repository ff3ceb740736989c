// float16 instantiations of the attention kernels on the emulator.
#include "emu_attention_impl.h"

namespace emu_ops {
EMU_INSTANTIATE_ATTENTION(__half, __half)
}
