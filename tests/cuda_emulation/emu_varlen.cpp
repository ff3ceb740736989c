// Replays varlen_attention.cu's host code on the emulator, with the kernels of
// csrc/cuda/attention/varlen_attention_kernels.cuh (all dtypes and head-size buckets) and
// varlen_attention_tc_kernels.cuh (as planned for the case's compute capability, cc);
// also defines the storage of the kernel's dynamic shared memory
// (`extern __shared__ float varlen_smem[]`). emu_varlen_fp8.cpp includes this file with
// EMU_VARLEN_FP8 defined for the fp8-cache instantiations (a second translation unit, so
// they compile in parallel).
#include <climits>
#include <stdexcept>
#include <string>

#include "cuda/attention/kernel_instances.cuh"
#include "emu_ops.h"
#include "emu_runtime.h"

#ifndef EMU_VARLEN_FP8  // defined once, here; emu_varlen_fp8.cpp shares it
CUDA_EMU_DYNAMIC_SHARED(vllm_lite::cuda::varlen, float, varlen_smem)
#endif

namespace emu_ops {

namespace varlen = vllm_lite::cuda::varlen;

template <typename T, typename CT>
void varlen_paged_attention(const VarlenArgs& d, void* out) {
  if (d.num_tokens == 0 || d.num_heads == 0 || d.num_seqs == 0 || d.max_query_len == 0) return;
  const varlen::VarlenLaunch launch = varlen::plan_varlen_launch<T, CT>(
      static_cast<int>(d.cc), d.num_seqs, d.num_kv_heads, d.num_heads / d.num_kv_heads,
      d.head_size, d.max_query_len);
  if (d.path_out != nullptr) *d.path_out = static_cast<int32_t>(launch.path);
  const varlen::VarlenPlan& plan = launch.plan;
  if (plan.grid_x > INT_MAX) {
    throw std::runtime_error("varlen_paged_attention: too many CTAs for one launch (" +
                             std::to_string(plan.grid_x) + ")");
  }
  const varlen::VarlenParams p = varlen::make_varlen_params(
      plan, d.num_seqs, d.num_tokens, d.num_heads, d.num_kv_heads, d.head_size, d.block_size,
      d.num_blocks, d.max_blocks_per_seq, d.q_stride_seq, d.q_stride_head, d.scale,
      d.k_scale, d.v_scale, out, d.query, d.key_cache, d.value_cache, d.block_tables,
      d.seq_lens, d.query_start_loc, d.alibi_slopes, d.flash_layout);
  cuda_emu::launch(launch.kernel, dim3(static_cast<unsigned>(plan.grid_x)),
                   dim3(static_cast<unsigned>(launch.threads)), plan.smem_bytes,
                   launch.path == vllm_lite::cuda::attn::VarlenPath::kTensorCore
                       ? "varlen_paged_attention_tc_kernel"
                       : "varlen_paged_attention_kernel",
                   p);
}

#ifndef EMU_VARLEN_FP8
template void varlen_paged_attention<float, float>(const VarlenArgs&, void*);
template void varlen_paged_attention<__half, __half>(const VarlenArgs&, void*);
template void varlen_paged_attention<__nv_bfloat16, __nv_bfloat16>(const VarlenArgs&, void*);
#else
using vllm_lite::cuda::fp8_e4m3;
using vllm_lite::cuda::fp8_e5m2;
template void varlen_paged_attention<float, fp8_e4m3>(const VarlenArgs&, void*);
template void varlen_paged_attention<__half, fp8_e4m3>(const VarlenArgs&, void*);
template void varlen_paged_attention<__nv_bfloat16, fp8_e4m3>(const VarlenArgs&, void*);
template void varlen_paged_attention<float, fp8_e5m2>(const VarlenArgs&, void*);
template void varlen_paged_attention<__half, fp8_e5m2>(const VarlenArgs&, void*);
template void varlen_paged_attention<__nv_bfloat16, fp8_e5m2>(const VarlenArgs&, void*);
#endif

}  // namespace emu_ops
