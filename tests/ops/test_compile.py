"""The wrappers trace under torch.compile(fullgraph=True): the compiled function gives the
eager result bit for bit and mutates the same caches."""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_lite import ops

from .reference import assert_bitwise_equal, elem_x, ref_paged_attention, tol

# aot_eager traces through dynamo and AOTAutograd (functionalization of the mutating ops)
# in seconds. Inductor adds C++ code generation, about a minute cold on 2 cores here: opt in
# with VLLM_LITE_TEST_INDUCTOR=1.
BACKENDS = ["aot_eager"] + (["inductor"] if os.environ.get("VLLM_LITE_TEST_INDUCTOR") else [])


def _inputs(device, max_seq_len, dtype=torch.float16, h=8, kvh=2, d=64, bs=16):
    g = torch.Generator().manual_seed(max_seq_len)
    lens = [max_seq_len, max(1, max_seq_len // 3), 1]
    cols = -(-max_seq_len // bs)
    nb = len(lens) * cols + 2
    ids = torch.randperm(nb, generator=g)[: len(lens) * cols].view(len(lens), cols).int()
    x = elem_x(dtype)
    kc = torch.randn(nb, kvh, d // x, bs, x, generator=g).to(dtype)
    vc = torch.randn(nb, kvh, d, bs, generator=g).to(dtype)
    # The newest token of each sequence is written by the compiled function itself.
    slots = torch.tensor([int(ids[s, (n - 1) // bs]) * bs + (n - 1) % bs
                          for s, n in enumerate(lens)])
    new_k = torch.randn(len(lens), kvh, d, generator=g).to(dtype)
    new_v = torch.randn(len(lens), kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    t = dict(key=new_k, value=new_v, key_cache=kc, value_cache=vc, slots=slots, query=q,
             tables=ids, seq_lens=torch.tensor(lens, dtype=torch.int32))
    return {k: v.to(device) for k, v in t.items()}


def _step_fn(max_seq_len, kvh=2, bs=16, d=64):
    scale = 1 / math.sqrt(d)

    def step(key, value, key_cache, value_cache, slots, query, tables, seq_lens):
        ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
        out = ops.paged_attention(query, key_cache, value_cache, kvh, scale, tables, seq_lens,
                                  bs, max_seq_len)
        return out * 2  # something for the compiler to fuse around the op

    return step


@pytest.mark.parametrize("compiler", BACKENDS)
@pytest.mark.parametrize("max_seq_len", [200, 1500], ids=["v1", "v2"])
def test_compile_reshape_and_cache_then_attention(device, compiler, max_seq_len):
    assert ops.use_v2(max_seq_len, 3, 8) == (max_seq_len > 512)
    torch._dynamo.reset()
    step = _step_fn(max_seq_len)
    eager_in = _inputs(device, max_seq_len)
    comp_in = {k: v.clone() for k, v in eager_in.items()}
    want = step(**eager_in)
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    got = compiled(**comp_in)
    assert_bitwise_equal(got, want, "compiled vs eager output")
    for k in eager_in:
        assert_bitwise_equal(comp_in[k], eager_in[k], f"{k} after compiled vs eager call")
    ref, _ = ref_paged_attention(eager_in["query"], eager_in["key_cache"],
                                 eager_in["value_cache"], 2, 1 / 8, eager_in["tables"],
                                 eager_in["seq_lens"], 16)
    torch.testing.assert_close(got.cpu().double(), 2 * ref, **tol(torch.float16))
    # A second call with new values reuses the graph and still mutates the caches.
    comp_in["key"].mul_(-1)
    eager_in["key"].mul_(-1)
    assert_bitwise_equal(compiled(**comp_in), step(**eager_in), "second call")
    assert_bitwise_equal(comp_in["key_cache"], eager_in["key_cache"], "key_cache, 2nd call")


@pytest.mark.parametrize("compiler", BACKENDS)
def test_compile_cache_management_ops(device, compiler):
    """copy_blocks (lists of mutated tensors), swap_blocks and reshape_and_cache_flash."""
    torch._dynamo.reset()

    def fn(key, value, fk, fv, slots, kcs, vcs, mapping, host):
        ops.reshape_and_cache_flash(key, value, fk, fv, slots, "auto", 1.0, 1.0)
        ops.copy_blocks(kcs, vcs, mapping)
        ops.swap_blocks(kcs[0], host, torch.tensor([[1, 0], [3, 2]]))
        return fk.sum() + kcs[1].sum()

    def make():
        gg = torch.Generator().manual_seed(6)
        return dict(
            key=torch.randn(4, 2, 32, generator=gg).to(device),
            value=torch.randn(4, 2, 32, generator=gg).to(device),
            fk=torch.zeros(5, 8, 2, 32, device=device),
            fv=torch.zeros(5, 8, 2, 32, device=device),
            slots=torch.tensor([0, 9, -1, 39], device=device),
            kcs=[torch.randn(5, 2, 8, 8, 4, generator=gg).to(device) for _ in range(2)],
            vcs=[torch.randn(5, 2, 32, 8, generator=gg).to(device) for _ in range(2)],
            mapping=torch.tensor([[0, 1], [0, 3], [4, 2]], device=device),
            host=torch.zeros(3, 2, 8, 8, 4),
        )

    a, b = make(), make()
    want = fn(**a)
    got = torch.compile(fn, fullgraph=True, backend=compiler)(**b)
    torch.testing.assert_close(got, want)  # a sum: inductor may reorder it
    for k in a:
        xs, ys = (a[k], b[k]) if isinstance(a[k], list) else ([a[k]], [b[k]])
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert_bitwise_equal(y, x, f"{k}[{i}] compiled vs eager")
    assert torch.equal(b["host"][0].cpu(), b["kcs"][0][1].cpu())
