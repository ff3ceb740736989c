// The baseline build of the int8 / int4 weight-only linear kernels (any CPU: SSE2 on x86-64, NEON
// on aarch64, whatever the compiler's default target vectorizes to).
#define VLLM_LITE_INT8_FN int8_linear_generic
#define VLLM_LITE_INT4_FN int4_linear_generic
#include "cpu/int8_linear_kernel.h"
