// One decode step with vllm_lite's kernels from C++: write the prompt's K/V into a paged
// cache with reshape_and_cache, then attend from one new query token per sequence with
// paged_attention_v1, and check the result against plain ATen attention.
// Exit status 0 when they agree. Pass "cuda" to run on the GPU (a build with CUDA kernels).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <vllm_lite/kernels.h>

int main(int argc, char** argv) {
  const at::Device device(argc > 1 ? std::string(argv[1]) : std::string("cpu"));
  const int64_t num_seqs = 2, num_heads = 8, num_kv_heads = 2, head_size = 64;
  const int64_t block_size = 16, num_blocks = 16;
  const int64_t seq_lens_host[] = {37, 20};  // tokens already in each sequence
  const auto dtype = at::kFloat;
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  at::manual_seed(0);

  // The paged cache (layouts of <vllm_lite/ops.h>); sequence s owns blocks {s, s+2, s+4, ...}.
  const int64_t x = vllm_lite::kv_cache_x(dtype);
  auto key_cache = at::zeros({num_blocks, num_kv_heads, head_size / x, block_size, x}, opts);
  auto value_cache = at::zeros({num_blocks, num_kv_heads, head_size, block_size}, opts);
  const int64_t max_blocks = 3;
  auto block_tables = at::empty({num_seqs, max_blocks}, at::kInt);
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t b = 0; b < max_blocks; ++b) block_tables[s][b] = static_cast<int>(s + 2 * b);
  }

  // Prefill: K/V of every token, written to its slot (block * block_size + offset).
  std::vector<at::Tensor> keys, values;
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < num_seqs; ++s) {
    keys.push_back(at::randn({seq_lens_host[s], num_kv_heads, head_size}, opts));
    values.push_back(at::randn({seq_lens_host[s], num_kv_heads, head_size}, opts));
    for (int64_t t = 0; t < seq_lens_host[s]; ++t) {
      slots.push_back(block_tables[s][t / block_size].item<int64_t>() * block_size +
                      t % block_size);
    }
  }
  const auto slot_mapping = at::tensor(slots, at::kLong).to(device);
  vllm_lite::reshape_and_cache(at::cat(keys), at::cat(values), key_cache, value_cache,
                               slot_mapping, "auto", 1.0, 1.0);

  // Decode: one query token per sequence.
  const auto query = at::randn({num_seqs, num_heads, head_size}, opts);
  auto out = at::empty_like(query);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_size));
  const auto seq_lens = at::tensor({37, 20}, at::kInt).to(device);
  vllm_lite::paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                                block_tables.to(device), seq_lens, block_size,
                                /*max_seq_len=*/37, /*alibi_slopes=*/std::nullopt, "auto",
                                1.0, 1.0);

  // The same attention with plain ATen ops on the unpaged K/V.
  double worst = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const auto group = num_heads / num_kv_heads;
    const auto k = keys[s].to(at::kDouble).repeat_interleave(group, 1);    // [T, H, D]
    const auto v = values[s].to(at::kDouble).repeat_interleave(group, 1);
    const auto q = query[s].to(at::kDouble);                                // [H, D]
    const auto probs = at::softmax(at::einsum("hd,thd->ht", {q, k}) * scale, -1);
    const auto expected = at::einsum("ht,thd->hd", {probs, v});
    worst = std::max(worst, (out[s].to(at::kDouble) - expected).abs().max().item<double>());
  }
  std::printf("decode step on %s: max |paged_attention_v1 - reference| = %.3g\n",
              device.str().c_str(), worst);
  if (!(worst < 1e-4)) {
    std::fprintf(stderr, "MISMATCH: expected at most 1e-4\n");
    return 1;
  }
  return 0;
}
