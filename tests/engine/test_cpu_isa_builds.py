"""The engine end to end on every CPU kernel build this machine can run
(``ops.cpu_isas()``: e.g. amxbf16, avx512bf16, avx512, avx2 and generic on an AMX machine,
avx2 and generic on an AVX2-only one), each selected with ``ops.set_cpu_isa`` before the
model loads (the load picks the GEMM path from the build). tests/ops checks each build's
kernels one by one; this runs them together (prepared projections, chunked varlen
prefill, paged decode v1 and v2, greedy sampling) so that a regression in a build other
than the machine's default shows on any machine, not only on a CPU whose widest build it
is.

One LLM per (build, dtype) on a tiny random Llama: prompts of 3, 40 and 530 tokens (the
longest crosses a 512-token partition, so its decode takes paged attention v2), chunked
prefill in 64-token steps, 6 greedy tokens. Reference: HF transformers' float32 forward on
the weights the engine holds (bf16-rounded for bfloat16) over the prompt and the engine's
tokens. Checked: every prompt token's and generated token's logprob (float32: 1e-4;
bfloat16: bf16 rounding of activations), and each generated token is the reference's
argmax (bfloat16: up to a near-tie within the same tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from models.helpers import assert_all_free, hf_logits, make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams, ops  # noqa: E402

VOCAB = 320
PROMPT_LENS = (3, 40, 530)
MAX_TOKENS = 6
# Largest |logprob - reference| accepted: float32 differs from HF only in summation order;
# bfloat16 rounds every activation (and, on AVX512-BF16, the attention probabilities).
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    config = make_config("llama")
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    config.max_position_embeddings = 1024
    folder = tmp_path_factory.mktemp("isa_llama")
    return folder, save_hf_model(config, folder)


@pytest.fixture(params=ops.cpu_isas())
def cpu_build(request: pytest.FixtureRequest) -> Any:
    """Each CPU build in turn, restored afterwards."""
    before = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_cpu_isa(before)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_matches_hf_on_each_cpu_build(checkpoint: tuple[Path, Any], cpu_build: str,
                                             dtype: str) -> None:
    folder, hf_model = checkpoint
    llm = LLM(str(folder), dtype=dtype, device="cpu", block_size=16, kv_cache_space=0.05,
              swap_space=0.01, enable_chunked_prefill=True, max_num_batched_tokens=64,
              max_num_seqs=4)
    assert ops.cpu_isa() == cpu_build
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert_all_free(llm)

    # The reference runs the weights the engine holds: bf16 ones rounded first.
    ref_model = hf_model
    if dtype == "bfloat16":
        ref_model = type(hf_model)(hf_model.config).eval()
        ref_model.load_state_dict({k: v.to(torch.bfloat16).float()
                                   for k, v in hf_model.state_dict().items()})
    tol = LOGPROB_TOL[dtype]
    for out, prompt in zip(outs, _prompts()):
        c = out.outputs[0]
        assert out.prompt_token_ids == prompt and len(c.token_ids) == MAX_TOKENS
        seq = prompt + list(c.token_ids)
        ref = torch.log_softmax(hf_logits(ref_model, torch.tensor(seq)).double(), dim=-1)
        where = f"{cpu_build} {dtype}, prompt of {len(prompt)}"
        plp = out.prompt_logprobs
        got = torch.tensor([plp[i][prompt[i]].logprob for i in range(1, len(prompt))])
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        err = (got.double() - want).abs().max().item()
        assert err < tol, f"{where}: prompt logprobs off by {err:.2e}"
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(lp[tok].logprob - row[tok].item()) < tol, (
                f"{where}: token {j} logprob {lp[tok].logprob} vs {row[tok].item()}")
            if dtype == "float32":
                assert tok == int(row.argmax()), f"{where}: token {j} is not greedy"
            else:
                assert row[tok].item() >= row.max().item() - tol, (
                    f"{where}: token {j} is not greedy (beyond a bf16 near-tie)")
