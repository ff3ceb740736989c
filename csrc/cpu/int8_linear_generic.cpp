// The baseline build of the int8 weight-only linear kernel (any CPU: SSE2 on x86-64, NEON
// on aarch64, whatever the compiler's default target vectorizes to).
#define VLLM_LITE_INT8_FN int8_linear_generic
#include "cpu/int8_linear_kernel.h"
