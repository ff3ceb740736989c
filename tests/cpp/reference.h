// Test inputs and a naive reference for the C++ tests. The reference reads K and V through
// the block table token by token (block = table[t / block_size], offset = t % block_size)
// in float64 loops, from the very (rounded) values the kernel sees; it shares no code with
// the kernels.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace vllm_lite::test {

struct PagedKV {
  at::Tensor key_cache;     // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  at::Tensor value_cache;   // [num_blocks, num_kv_heads, head_size, block_size]
  at::Tensor block_tables;  // int32 [num_seqs, max_blocks_per_seq]
  at::Tensor seq_lens;      // int32 [num_seqs]
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t head_size;
};

at::Generator make_gen(uint64_t seed);

// Random K/V for each sequence in a shuffled pool with spare blocks. Every slot no
// sequence reads is NaN, and table columns past a sequence's last block name NaN blocks.
PagedKV make_paged_kv(const std::vector<int>& seq_lens, int64_t num_kv_heads,
                      int64_t head_size, int64_t block_size, at::ScalarType dtype,
                      at::Generator& gen);

// out [num_seqs, num_heads, head_size] in float64; a sequence of length 0 gives zeros.
at::Tensor ref_paged_attention(const at::Tensor& query, const PagedKV& kv, double scale,
                               const std::optional<at::Tensor>& alibi_slopes);

// Elements per 16-byte chunk, computed here rather than taken from the library.
int64_t elem_x(at::ScalarType dtype);

// |actual - expected| <= atol + rtol * |expected| everywhere (per-dtype tolerances as in
// tests/ops/reference.py); NaN never passes.
void check_close(const at::Tensor& actual, const at::Tensor& expected, at::ScalarType dtype,
                 const std::string& what);

// Same shape, dtype and bytes (NaN equals NaN with the same bits).
void check_bitwise_equal(const at::Tensor& actual, const at::Tensor& expected,
                         const std::string& what);

}  // namespace vllm_lite::test
