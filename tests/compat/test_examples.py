"""The integration examples in examples/python run as written, and compute what the plain
PyTorch math gives."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
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


def _tiny_hf_llama(folder: Path) -> Path:
    """A tiny random Llama with a tokenizer and a chat template, saved to ``folder``."""
    from models.helpers import make_config, make_tokenizer, save_hf_model

    config = make_config("llama")
    config.vocab_size = 320
    save_hf_model(config, folder)
    make_tokenizer(folder)
    return folder


def test_hf_generate_batch_runs_as_a_script(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = _tiny_hf_llama(tmp_path / "tiny")
    out = subprocess.run([sys.executable, str(EXAMPLES / "hf_generate_batch.py"), str(folder)],
                         capture_output=True, text=True, timeout=300, env=cli_env(), cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Q: ") == 2 and out.stdout.count("A: ") == 2


def test_hf_generate_batch_equals_sdpa(tmp_path: Path) -> None:
    """The example's answers on vllm_lite's kernels are HF's own (sdpa) answers."""
    pytest.importorskip("transformers")
    folder = str(_tiny_hf_llama(tmp_path / "tiny"))
    example = runpy.run_path(str(EXAMPLES / "hf_generate_batch.py"))
    qs = ["one two three", "four"]
    ours = example["generate_batch"](folder, qs, max_new_tokens=8)
    want = example["generate_batch"](folder, qs, max_new_tokens=8, attn_implementation="sdpa")
    assert ours == want and all(ours)  # each answer some text, the same as sdpa's
