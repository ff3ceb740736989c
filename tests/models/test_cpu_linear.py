"""models.llama.Linear's CPU weight forms (oneDNN-prepacked float32 and bfloat16, the
packed_linear-packed float32 / bfloat16 where vllm_lite's kernel is selected) against a
float64 matmul / plain F.linear on the original weight, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_lite import ops
from vllm_lite.models.llama import Linear


def _linear(dtype: torch.dtype, bias: bool, seed: int) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = Linear(96, 160, bias=bias).to(dtype)
    return lin, lin.weight.detach().clone()


@pytest.mark.parametrize("bias", [False, True])
def test_float32_onednn_weight(bias: bool) -> None:
    lin, ref_w = _linear(torch.float32, bias, seed=1)
    lin.prepare_for_cpu()
    if ops.packed_linear_kernel_selected(torch.float32):
        # vllm_lite's own kernel (tests/ops/test_packed_linear.py), no oneDNN copy
        assert lin._own_packed is not None and lin._packed is None
    elif not torch.backends.mkldnn.is_available():
        assert lin._packed is None
        pytest.skip("torch without oneDNN: Linear keeps F.linear")
    else:
        assert lin._packed is not None and lin._own_packed is None
    # The parameter itself is untouched (state_dict, TP loading and tied embeddings read it).
    assert torch.equal(lin.weight, ref_w) and lin.weight.is_contiguous()
    b64 = lin.bias.double() if bias else None
    with torch.no_grad():
        for rows in (1, 8, 33, 300):
            x = torch.randn(rows, 96)
            ref = F.linear(x.double(), ref_w.double(), b64)
            out = lin(x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        x = torch.randn(5, 200)[:, 50:146]  # a strided input
        torch.testing.assert_close(lin(x).double(), F.linear(x.double(), ref_w.double(), b64),
                                   atol=2e-5, rtol=1e-5)
        x = torch.randn(2, 3, 96)  # leading batch dims, as F.linear
        assert lin(x).shape == (2, 3, 160)
    assert set(lin.state_dict()) == ({"weight", "bias"} if bias else {"weight"})


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_prepacked_weight(bias: bool) -> None:
    lin, ref_w = _linear(torch.bfloat16, bias, seed=2)
    lin.prepare_for_cpu()
    if ops.packed_linear_kernel_selected(torch.bfloat16):  # vllm_lite's own kernel, no oneDNN copy
        assert lin._own_packed is not None and lin._packed is None
    else:
        assert lin._own_packed is None
        if not torch.backends.mkldnn.is_available():
            pytest.skip("torch without oneDNN: Linear keeps F.linear")
        try:  # oneDNN packs bf16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 16)
        except RuntimeError as e:
            assert lin._packed is None  # and Linear falls back to F.linear
            pytest.skip(f"no bf16 weight packing on this CPU: {e}")
        assert lin._packed is not None
    with torch.no_grad():
        for rows in (1, 16, 64, 300):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            # bf16 outputs: one rounding step apart at most (the same math, maybe another
            # accumulation order on another CPU).
            torch.testing.assert_close(lin(x).float(), F.linear(x, ref_w, lin.bias).float(),
                                       atol=2e-2, rtol=1.6e-2)
        x = torch.randn(5, 200, dtype=torch.bfloat16)[:, 50:146]  # a strided input
        torch.testing.assert_close(lin(x).float(), F.linear(x, ref_w, lin.bias).float(),
                                   atol=2e-2, rtol=1.6e-2)
    # With autograd on, the packed copy (which has no gradient) is not used.
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    out = lin(x)
    assert out.requires_grad
    out.float().sum().backward()
    assert lin.weight.grad is not None


def test_prepare_for_cpu_leaves_other_devices_alone() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lin = Linear(96, 160).cuda()
    lin.prepare_for_cpu()
    assert lin._packed is None and lin.weight.is_contiguous()
