// paged_attention_v2's reduce on CUDA: the attention kernel (paged_attention_v1.cu's
// launch_paged_attention) runs one CTA per (sequence, kv head[, head group], 512-token
// partition) and writes each partition's max logit, exp sum and normalized output to the
// caller's scratch; the reduce kernel launched here combines the partitions into out. See
// attention_kernels.cuh. No torch header (see launch_types.h).
#include <climits>

#include <cuda_runtime.h>

#include "cuda/attention/attention_kernels.cuh"
#include "cuda/attention/attention_launch.h"
#include "cuda/dtype.cuh"

namespace vllm_lite {
namespace cuda {
namespace attn {

cudaError_t launch_paged_attention_v2_reduce(FloatType dtype, void* out, const float* exp_sums,
                                             const float* max_logits, const void* tmp_out,
                                             const int32_t* seq_lens, int64_t max_tokens,
                                             int64_t num_seqs, int64_t num_heads,
                                             int64_t head_size, int64_t num_partitions,
                                             cudaStream_t stream) {
  const int64_t grid_x = num_seqs * num_heads;
  TORCH_CHECK(grid_x <= INT_MAX, "paged_attention_v2: too many (sequence, head) pairs (",
              grid_x, ") for one launch");
  ReduceParams rp{};
  rp.out = out;
  rp.exp_sums = exp_sums;
  rp.max_logits = max_logits;
  rp.tmp_out = tmp_out;
  rp.seq_lens = seq_lens;
  rp.max_tokens = max_tokens;
  rp.num_heads = static_cast<int>(num_heads);
  rp.head_size = static_cast<int>(head_size);
  rp.num_partitions = static_cast<int>(num_partitions);
  dispatch_float_type(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    paged_attention_v2_reduce_kernel<scalar_t>
        <<<static_cast<unsigned>(grid_x), kThreads, 0, stream>>>(rp);
  });
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace cuda
}  // namespace vllm_lite
