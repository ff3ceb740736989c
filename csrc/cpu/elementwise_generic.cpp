// The portable build of the CPU element-wise kernels: the compiler's baseline target (SSE2
// on x86-64, NEON on aarch64). Always available.
#include <cmath>

#define VLLM_LITE_ELEMENTWISE_FN elementwise_generic
#define VLLM_LITE_VEC_WIDTH 4
#include "cpu/elementwise_kernel.h"
