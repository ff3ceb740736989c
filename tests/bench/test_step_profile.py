"""The engine step profile (vllm-lite bench profile) on a tiny model: both kinds of step
are seen, every phase has a row, the phases add up to the step, the decode steps hold one
token per request, and bad sizes are refused."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from models.helpers import make_config, save_hf_model  # noqa: E402
from benchmarks import step_profile  # noqa: E402


def _args(model: Path, out: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    step_profile.add_arguments(p)
    argv = ["--model", str(model), "--dtype", "float32", "--kv-cache-space", "0.01",
            "--threads", "1", "--out", str(out)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([str(v)] if v != "" else [])
    return p.parse_args(argv)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_profile_accounts_for_the_whole_step(tmp_path: Path, temperature: float) -> None:
    model = tmp_path / "model"
    save_hf_model(make_config("llama"), model)
    report = step_profile.run(_args(model, tmp_path, num_requests=3, input_len=9,
                                    output_len=5, temperature=temperature))
    assert ("greedy," if temperature == 0 else "temperature 0.7,") in report, report
    rows = {m.group(1): m.group(2) for m in
            re.finditer(r"^\| ([a-z_ ]+) \| (.*) \|$", report, re.M)}
    assert set(step_profile.PHASES) <= set(rows), report
    for kind in (0, 1):  # prefill, decode
        shares = [float(re.findall(r"\((-?\d+)%\)", rows[p])[kind]) for p in step_profile.PHASES]
        assert abs(sum(shares) - 100) <= len(shares), (kind, shares)  # rounding only
        assert all(s >= 0 for s in shares[:-1]), shares
    step = rows["step"]
    # 3 prompts of 9 tokens in one prefill step; then 4 decode steps of 3 tokens.
    assert re.search(r"\(1 steps, 27 tokens each\).*\(4 steps, 3 tokens each\)", step), step


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--output-len must be >= 1"):
        step_profile.run(_args(tmp_path, tmp_path, output_len=0))
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        step_profile.run(_args(tmp_path, tmp_path, temperature=-1))


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "per-layer"])
def test_host_time_reports_each_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        one_call: bool) -> None:
    """Both ways the decoder layers run: in one native call where the CPU has a packed GEMM
    (the kernel and GEMM times then come from a layer-by-layer run of the same steps), and
    layer by layer (the model's fused_decode off)."""
    from vllm_lite import ops
    from vllm_lite.models.llama import LlamaModel

    if one_call and not ops.packed_linear_kernel_selected(torch.float32):
        pytest.skip("this CPU build has no packed float32 GEMM: no one-call decode")
    if not one_call:
        monkeypatch.setattr(LlamaModel, "fused_decode", False)
    before = LlamaModel.fused_decode
    report = step_profile.run(_args(tmp_path, tmp_path, host_time="", num_seqs=3,
                                    contexts="9,40", decode_steps=2))
    assert "3 sequences decoding together, mean of 2 decode steps" in report, report
    rows = re.findall(r"^\| (\d+) \| (one call|per layer) \| ([\d.]+) \| ([\d.]+) \| "
                      r"\*\*(-?[\d.]+)\*\* \| (-?[\d.]+) \| ([\d.]+) \| (-?[\d.]+) \|$",
                      report, re.M)
    ways = ["per layer", "one call"] if one_call else ["per layer"]
    assert [r[:2] for r in rows] == [(c, w) for c in ("9", "40") for w in ways], report
    for _, layers, step, kernel, host, cpu, gemm, rest in rows:
        step, kernel, host = float(step), float(kernel), float(host)
        assert 0 < kernel < step and abs(step - kernel - host) < 0.02, report
        # The GEMMs are timed (the model's projections ran) and part of the host CPU time.
        assert 0 < float(gemm) and abs(float(cpu) - float(gemm) - float(rest)) < 0.02, report
    assert LlamaModel.fused_decode is before, "the model's setting is restored after the run"


def test_host_time_takes_the_output_kind(tmp_path: Path) -> None:
    report = step_profile.run(_args(tmp_path, tmp_path, host_time="", num_seqs=2,
                                    contexts="9", decode_steps=1, output_kind="final_only"))
    assert "output_kind final_only;" in report, report
    with pytest.raises(SystemExit):
        _args(tmp_path, tmp_path, host_time="", output_kind="delta")


def test_host_time_takes_the_temperature(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite.layers.sampler import Sampler

    draws: list[int] = []
    draw = Sampler._draw
    monkeypatch.setattr(Sampler, "_draw",
                        lambda self, *a: draws.append(len(a[-1])) or draw(self, *a))
    report = step_profile.run(_args(tmp_path, tmp_path, host_time="", num_seqs=2,
                                    contexts="9", decode_steps=1, temperature=0.8))
    assert "temperature 0.8, output_kind" in report, report
    assert draws and set(draws) == {2}, draws  # every step drew both rows' tokens
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        step_profile.run(_args(tmp_path, tmp_path, host_time="", temperature=-1))


def test_host_time_with_a_tokenizer_makes_text(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite.detokenizer import IncrementalDetokenizer

    texts: list[str] = []
    add_tokens = IncrementalDetokenizer.add_tokens
    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens",
                        lambda self, ids: texts.append(add_tokens(self, ids)) or texts[-1])
    report = step_profile.run(_args(tmp_path, tmp_path, host_time="", num_seqs=2,
                                    contexts="9", decode_steps=1, tokenizer="bpe"))
    assert "tokenizer bpe," in report, report
    # Every decode step of both sequences made text.
    assert len(texts) >= 2 * (step_profile.HOST_WARMUP_STEPS + 1) and "".join(texts), texts
    with pytest.raises(SystemExit):
        _args(tmp_path, tmp_path, host_time="", tokenizer="gpt2")


def test_micro_tokenizer_covers_the_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    step_profile._save_micro_tokenizer(tmp_path, vocab=512)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 512 and tok.eos_token_id == 0
    assert all(tok.convert_ids_to_tokens(i) is not None for i in range(512))


def test_decode_time_on_the_cpu_runs_eagerly(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_hf_model(make_config("llama"), model)
    report = step_profile.run(_args(model, tmp_path, decode_time="", batch_sizes="1,3",
                                    input_len=9, decode_steps=2, device="cpu"))
    assert "the CPU runs eagerly (no graphs)" in report, report
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d,]+) \|$", report, re.M)
    assert [r[0] for r in rows] == ["1", "3"], report
    for n, ms, tok_s in rows:
        assert float(ms) > 0
        assert abs(float(tok_s.replace(",", "")) - int(n) / (float(ms) / 1e3)) <= \
            0.01 * int(n) / (float(ms) / 1e3) + 1, report


def test_host_and_decode_time_are_separate_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose one"):
        step_profile.run(_args(tmp_path, tmp_path, host_time="", decode_time=""))
