"""The engine step profile (vllm-lite bench profile) on a tiny model: both kinds of step
are seen, every phase has a row, the phases add up to the step, the decode steps hold one
token per request, and bad sizes are refused."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from models.helpers import make_config, save_hf_model  # noqa: E402
from benchmarks import step_profile  # noqa: E402


def _args(model: Path, out: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    step_profile.add_arguments(p)
    argv = ["--model", str(model), "--dtype", "float32", "--kv-cache-space", "0.01",
            "--threads", "1", "--out", str(out)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
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
