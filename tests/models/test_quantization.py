"""Weight-only int8 quantization (quantization="int8"): the quantizer's error bound, the
quantized GEMM against a float64 matmul on the dequantized weights, and the engine's
greedy outputs equal to the same model with its projections replaced by the dequantized
weights (the quantization error is the only difference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import cli_env, make_llm  # noqa: E402
from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams, ops  # noqa: E402
from vllm_lite.layers.quantization import (  # noqa: E402
    Int8Linear,
    dequantize_int8,
    quantize_int8,
    quantize_model,
)

# Relative to max |reference|: float32 accumulates like the reference; bfloat16 rounds the
# activations and the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_int8_error_bound(seed: int) -> None:
    w = _randn(48, 72, seed=seed) * torch.rand(48, 1, generator=torch.Generator().manual_seed(9))
    w[5] = 0.0  # an all-zero row: scale 1, q 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (48,)
    assert int(q.abs().max()) <= 127
    assert bool((q[5] == 0).all()) and float(scale[5]) == 1.0
    # Every row's largest weight is exactly +-127 steps; each weight within half a step.
    rows = [r for r in range(48) if r != 5]
    assert bool((q[rows].abs().amax(dim=1) == 127).all())
    err = (dequantize_int8(q, scale).double() - w.double()).abs()
    assert bool((err <= scale.double()[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_linear_matches_float64(dtype: torch.dtype, bias: bool, rows: int) -> None:
    lin = torch.nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_randn(40, 96, seed=rows))
        if bias:
            lin.bias.copy_(_randn(40, seed=rows + 1))
    lin = lin.to(dtype)
    q_lin = Int8Linear(lin)
    # packed in panels for the CPU GEMM where the selected build has packed_linear's kernel
    assert q_lin.qweight.dim() == (3 if ops.packed_quant_linear_kernel_selected() else 2)
    x = _randn(2, rows, 96, seed=rows + 2).to(dtype)  # a leading batch dim too
    out = torch.full((2, rows, 40), float("nan"), dtype=dtype)
    out.copy_(q_lin(x))
    deq = dequantize_int8(q_lin.qweight_rows(), q_lin.scales).double()
    ref = x.double() @ deq.t()
    if bias:
        ref = ref + lin.bias.detach().double()
    assert out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=0,
                               atol=TOLERANCE[dtype] * float(ref.abs().max()))


def test_quantize_model_skips_the_head() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(8, 4)))
    head = torch.nn.Linear(4, 3)
    model.append(head)
    assert quantize_model(model, None) == 0
    assert quantize_model(model, "int8", skip=(head,)) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    assert model[3] is head
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "gptq")
    with pytest.raises(ValueError, match="needs the checkpoint's quantized projections"):
        quantize_model(model, "gguf")


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "llama_linear_bias", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"q_{request.param}")
    save_hf_model(make_config(request.param), folder)
    return folder


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 160, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


def test_engine_int8_equals_the_dequantized_model(checkpoint: Path) -> None:
    quantized = make_llm(checkpoint, quantization="int8")
    model = quantized.llm_engine.model
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    layers = model.config.num_hidden_layers
    assert len(int8) == 4 * layers  # qkv, o, gate_up, down per layer; not the head
    assert not isinstance(model.lm_head, Int8Linear)
    # The reference: the same checkpoint unquantized, its projections replaced by the
    # dequantized weights.
    reference = make_llm(checkpoint)
    ref_model = reference.llm_engine.model
    ref_linears = {n: m for n, m in ref_model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not ref_model.lm_head}
    q_linears = dict(model.named_modules())
    assert set(ref_linears) == {n for n, m in q_linears.items() if isinstance(m, Int8Linear)}
    with torch.no_grad():
        for name, lin in ref_linears.items():
            q = q_linears[name]
            lin.weight.copy_(dequantize_int8(q.qweight_rows(), q.scales))
    ref_model.prepare_for_cpu()
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    got = quantized.generate(_prompts(), params, use_tqdm=False)
    want = reference.generate(_prompts(), params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob,
                                                                abs=1e-3)
    # Every KV block back after the run.
    bm = quantized.llm_engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks


def test_engine_int8_weights_take_a_quarter_of_float32(checkpoint: Path) -> None:
    def projection_bytes(llm: LLM) -> int:
        model = llm.llm_engine.model
        total = 0
        for m in model.modules():
            if isinstance(m, Int8Linear):
                # the weight's own bytes; packed for the CPU GEMM, at most 47 rows of
                # padding (the last panel of 48 output columns)
                rows = m.qweight_rows()
                assert m.qweight.numel() <= rows.numel() + 47 * rows.shape[1]
                total += rows.numel() * rows.element_size()
            elif isinstance(m, torch.nn.Linear) and m is not model.lm_head:
                total += m.weight.numel() * m.weight.element_size()
        return total

    assert projection_bytes(make_llm(checkpoint, quantization="int8")) * 4 == \
        projection_bytes(make_llm(checkpoint))


def test_quantization_none_keeps_the_weights(checkpoint: Path) -> None:
    """"none" (explicit) on a plain checkpoint: nothing quantized, as None."""
    llm = make_llm(checkpoint, quantization="none")
    assert llm.llm_engine.config.model_config.quantization is None
    assert not any(isinstance(m, Int8Linear) for m in llm.llm_engine.model.modules())


@pytest.mark.parametrize("bad", ["gptq", "awq", "fp8", "None", 8, True])
def test_unknown_quantization_is_refused(checkpoint: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="quantization"):
        make_llm(checkpoint, quantization=bad)


def test_gguf_quantization_needs_a_gguf_model(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        make_llm(checkpoint, quantization="gguf")


@pytest.mark.parametrize("method,group,message", [
    ("int8", 64, "int4's"), (None, 32, "int4's"), ("int4", 16, "32, 64, 128"),
    ("int4", True, "32, 64, 128")])
def test_group_size_only_with_int4(checkpoint: Path, method, group, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(checkpoint, quantization=method, quantization_group_size=group)


def test_cli_quantization_flag(model_dir: Path) -> None:
    """--quantization int8 runs with int8 projections; an unknown value is refused by the
    parser (exit 2). Once, not per architecture: the flag becomes the engine option that
    the tests above check on each. model_dir: a tiny Llama with a tokenizer."""
    # The vllm_lite these tests import (an in-place build is not installed), run from
    # outside the checkout.
    env = cli_env()
    base = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "generate", "--model",
            str(model_dir), "--kv-cache-space", "0.01", "--max-tokens", "2", "--dtype",
            "float32"]
    good = subprocess.run(base + ["--quantization", "int8", "hello"],
                          capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "projections int8" in good.stderr, good.stderr[-2000:]
    bad = subprocess.run(base + ["--quantization", "fp8", "hello"], capture_output=True,
                         text=True, timeout=120, cwd="/", env=env)
    assert bad.returncode == 2 and "quantization" in bad.stderr
    help_text = subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "generate",
                                "--help"], capture_output=True, text=True, timeout=120, cwd="/",
                               env=env)
    assert "--quantization" in help_text.stdout and "int8" in help_text.stdout
