"""The throughput benchmark's mixture-of-experts mode (``--random-model``): a random-weight
model of a named shape is written once and every engine runs it. The named shapes are
too big for a unit test, so a tiny one is registered here; no timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from benchmarks import random_models, throughput  # noqa: E402
from benchmarks.workload import WorkloadConfig, make_workload  # noqa: E402

TINY = ("MixtralConfig",
        dict(vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=True,
             rms_norm_eps=1e-6),
        "a tiny Mixtral")


@pytest.fixture
def tiny_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(random_models.SHAPES, "moe-tiny", TINY)
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "random-models"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    return p.parse_args(list(argv))


def test_moe_mode_runs_every_engine(tiny_shape: Path, tmp_path: Path) -> None:
    args = _args("--random-model", "moe-tiny", "--num-requests", "3", "--input-len", "4-12",
                 "--output-len", "2-6", "--hf-batch-size", "2", "--no-sweeps",
                 "--block-size", "4", "--kv-cache-space", "0.01", "--out", str(tmp_path / "out"),
                 "--no-progress", "--dtype", "float32")
    report = throughput.run(args)
    report.save()
    data = json.loads((tmp_path / "out" / f"{report.stem}.json").read_text())
    folder = tiny_shape / "moe-tiny-seed0"
    assert data["random_model"] == "moe-tiny" and data["model"] == str(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 8
    wanted = sum(r.output_len for r in make_workload(WorkloadConfig(3, (4, 12), (2, 6), seed=0),
                                                     160))
    engines = {r["engine"]: r for r in data["engines"]}
    assert set(engines) == {"vllm_lite", "hf_generate", "hf_generate_batch"}
    for run in engines.values():
        assert run["error"] is None, run["error"]
        assert run["output_tokens"] == wanted
    text = (tmp_path / "out" / f"{report.stem}.md").read_text()
    assert "random-weight Mixtral 'moe-tiny' (a tiny Mixtral" in text
    # A second run reads the folder written by the first.
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert random_models.materialize("moe-tiny") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_random_model_errors(tiny_shape: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--random-model 'nope' is not a known shape; known: "
                                         ".*moe-16x1024"):
        random_models.materialize("nope")
    args = _args("--random-model", "moe-tiny", "--model", str(tmp_path), "--quick")
    with pytest.raises(ValueError, match="name different models"):
        throughput.run(args)


def test_named_moe_shape_is_the_documented_one() -> None:
    """The benchmark's shape: 16 experts, top-2, hidden 1024, a MoE the engine runs."""
    cls, kw, _ = random_models.SHAPES["moe-16x1024"]
    assert cls == "MixtralConfig"
    assert (kw["num_local_experts"], kw["num_experts_per_tok"], kw["hidden_size"]) == (16, 2, 1024)
    assert 150e6 < random_models.parameter_count("moe-16x1024") < 180e6
