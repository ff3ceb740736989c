"""benchmarks/kernels.py --prefill: the FLOP count behind its TFLOP/s columns equals 4 * heads *
head_size times the (query, key) pairs a bottom-right causal mask keeps, counted here from
the mask itself."""

import pytest
import torch

from benchmarks.prefill_kernels import attention_flops


@pytest.mark.parametrize("seqs,new,prefix,heads,head_size",
                         [(1, 1, 0, 1, 8), (8, 5, 0, 4, 64), (3, 7, 11, 32, 128), (2, 16, 1, 9, 64)])
def test_attention_flops_counts_the_causal_mask(seqs, new, prefix, heads, head_size):
    total = prefix + new
    keep = torch.arange(total)[None, :] <= torch.arange(new)[:, None] + prefix
    assert attention_flops(seqs, new, prefix, heads, head_size) == \
        4 * heads * head_size * int(keep.sum()) * seqs
