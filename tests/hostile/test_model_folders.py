"""Hostile Hugging Face model folders against LLM(model=...), each load in the probe process
(memory limit, deadline): lying config sizes, lying or truncated safetensors, tensors of the
wrong shape or kind, unknown architectures, non-physical constants, and files that are
symlinks out of the folder. Each is refused with a ValueError naming the problem."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hostile import probes  # noqa: E402


def _copy(good: Path, tmp_path: Path, **config_changes: Any) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(good, folder)
    if config_changes:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config_changes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _rewrite_weights(folder: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


def test_the_honest_folder_loads(probe, good: Path) -> None:
    result = probe(probes.load_llm, str(good))
    assert result[0] == "ok" and len(result[1]) == 3, result


CONFIG_LIES = [
    (dict(hidden_size=10**9, num_attention_heads=1, num_key_value_heads=1), "GiB"),
    (dict(num_hidden_layers=10**6), "GiB"),
    (dict(vocab_size=2**40), "GiB"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(num_hidden_layers=-3), "num_hidden_layers"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(architectures=["EvilForCausalLM"]), "not supported"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(rope_theta=-10000.0), "rope_theta"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "rope_scaling.factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 1.0, "original_max_position_embeddings": 64}),
     "high_freq_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
     "rope_parameters.rope_theta"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
]


@pytest.mark.parametrize("changes,match", CONFIG_LIES, ids=[str(c) for c, _ in CONFIG_LIES])
def test_lying_configs(probe, good: Path, tmp_path: Path, changes: dict, match: str) -> None:
    probe.refuses(probes.load_llm, str(_copy(good, tmp_path, **changes)), match=match)


def test_lying_safetensors_headers(probe, good: Path, tmp_path: Path) -> None:
    folder = _copy(good, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    lies = [
        struct.pack("<Q", 1 << 60) + data[8:],  # header length past the file
        data[:8 + header_len // 2],  # cut in the header
        data[:len(data) - 64],  # cut in the data
    ]
    bad = dict(header)
    bad[name] = dict(bad[name], data_offsets=[0, 1 << 40])  # a tensor past the end
    text = json.dumps(bad).encode()
    text += b" " * (-len(text) % 8)
    lies.append(struct.pack("<Q", len(text)) + text + data[8 + header_len:])
    for lie in lies:
        weights.write_bytes(lie)
        probe.refuses(probes.load_llm, str(folder), match="model.safetensors")


@pytest.mark.parametrize("how", ["shape", "int8", "int32", "bool"])
def test_wrong_tensors(probe, good: Path, tmp_path: Path, how: str) -> None:
    folder = _copy(good, tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"

    def change(state: dict) -> None:
        t = state[key]
        if how == "shape":
            state[key] = t[:, :-1].contiguous()
        elif how == "bool":
            state[key] = t > 0
        else:
            state[key] = (t * 100).to(getattr(torch, how))

    _rewrite_weights(folder, change)
    match = "does not match" if how == "shape" else "torch." + how
    probe.refuses(probes.load_llm, str(folder), match=f"{key}|{match}")


def test_float64_tensors_are_cast(probe, good: Path, tmp_path: Path) -> None:
    """float64 is a floating format: cast to the model's dtype like float16 would be."""
    folder = _copy(good, tmp_path)
    _rewrite_weights(folder, lambda s: s.update(
        {"model.norm.weight": s["model.norm.weight"].double()}))
    result = probe(probes.load_llm, str(folder))
    assert result[0] == "ok", result


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json",
                                  "tokenizer_config.json"])
def test_symlinks_out_of_the_folder_are_refused(probe, good: Path, tmp_path: Path,
                                                name: str) -> None:
    folder = _copy(good, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / name, outside / name)
    os.symlink(outside / name, folder / name)
    probe.refuses(probes.load_llm, str(folder), match=f"{name}|outside the model folder")


def test_symlinks_inside_the_folder_and_hub_snapshots_load(probe, good: Path,
                                                           tmp_path: Path) -> None:
    """A link to a file of the folder itself is fine, and so is the Hugging Face hub cache's
    layout (snapshots/<rev>/<file> -> ../../blobs/<hash>)."""
    folder = _copy(good, tmp_path)
    shutil.move(folder / "config.json", folder / "real_config.json")
    os.symlink("real_config.json", folder / "config.json")
    assert probe(probes.load_llm, str(folder))[0] == "ok"

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in good.iterdir() if p.is_file())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    result = probe(probes.load_llm, str(snapshot))
    assert result[0] == "ok", result
