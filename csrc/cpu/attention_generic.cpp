// The portable build of the CPU attention kernel: the compiler's baseline target (SSE2 on
// x86-64, NEON on aarch64). Always available.
#define VLLM_LITE_ISA_FN attention_task_generic
#define VLLM_LITE_VEC_WIDTH 4
#include "cpu/attention_kernel.h"
