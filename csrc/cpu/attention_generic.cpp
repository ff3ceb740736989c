// The portable build of the CPU attention kernels (paged decode and varlen prefill): the
// compiler's baseline target (SSE2 on x86-64, NEON on aarch64). Always available.
#include <cmath>

#define VLLM_LITE_ISA_FN attention_task_generic
#define VLLM_LITE_VARLEN_ISA_FN varlen_task_generic
#define VLLM_LITE_VEC_WIDTH 4
#include "cpu/attention_kernel.h"
#include "cpu/varlen_attention_kernel.h"
