"""Code written against vLLM's kernels, run on vllm_lite's by changing one import.

The function below is written as a vLLM user would (vLLM's _custom_ops, its cache layouts,
its argument lists); only the import at the top differs. It writes a few tokens' keys and
values into a paged KV cache and runs one decode step of paged attention over them.

    python examples/python/vllm_ops_drop_in.py
"""

import torch

# from vllm import _custom_ops as ops   # with vLLM
from vllm_lite.compat import vllm as ops  # with vllm_lite


def decode_step(num_tokens: int = 37, num_heads: int = 8, num_kv_heads: int = 2,
                head_size: int = 64, block_size: int = 16, dtype=torch.bfloat16,
                device: str = "cpu") -> torch.Tensor:
    torch.manual_seed(0)
    x = 16 // torch.empty((), dtype=dtype).element_size()
    num_blocks = (num_tokens + block_size - 1) // block_size
    key_cache = torch.zeros(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            dtype=dtype, device=device)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head_size, block_size, dtype=dtype,
                              device=device)
    key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device)
    slot_mapping = torch.arange(num_tokens, device=device)
    one = torch.tensor(1.0, dtype=torch.float32, device=device)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "auto", one, one)

    query = torch.randn(1, num_heads, head_size, dtype=dtype, device=device)
    out = torch.empty_like(query)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads,
                           head_size ** -0.5, block_tables, seq_lens, block_size, num_tokens,
                           None, "auto", one, one)
    return out


if __name__ == "__main__":
    out = decode_step()
    print("attention output", tuple(out.shape), out.dtype, "first values",
          [round(v, 4) for v in out[0, 0, :4].float().tolist()])
