"""The integration examples in examples/python run as written, and compute what the plain
PyTorch math gives."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import torch

from entrypoints.utils import cli_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


def test_vllm_ops_drop_in_runs_as_a_script() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "vllm_ops_drop_in.py")],
                         capture_output=True, text=True, timeout=300, env=cli_env(), cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attention output (1, 8, 64) torch.bfloat16" in out.stdout


def test_vllm_ops_drop_in_computes_attention() -> None:
    example = runpy.run_path(str(EXAMPLES / "vllm_ops_drop_in.py"))
    out = example["decode_step"](dtype=torch.float32)
    # The same draws, attended in plain float64 PyTorch.
    torch.manual_seed(0)
    key = torch.randn(37, 2, 64).double().repeat_interleave(4, dim=1)
    value = torch.randn(37, 2, 64).double().repeat_interleave(4, dim=1)
    query = torch.randn(1, 8, 64).double()
    weights = torch.softmax(torch.einsum("qhd,khd->hqk", query, key) / 8.0, dim=-1)
    ref = torch.einsum("hqk,khd->qhd", weights, value)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
