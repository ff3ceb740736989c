"""What a tensor-parallel rank receives (vllm_lite.worker.tp_processes.config_for_ranks):
the engine's config with its transformers config as plain values, every attribute the
original gives unchanged, so a rank builds its model without importing transformers; a
config holding a value that needs transformers is sent as it is."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import run_python_json  # noqa: E402
from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite.config.args import EngineArgs  # noqa: E402
from vllm_lite.worker.tp_processes import HFConfigValues, config_for_ranks  # noqa: E402


def _engine_config(folder: Path) -> Any:
    return EngineArgs(model=str(folder), dtype="float32", device="cpu", tensor_parallel_size=2,
                      kv_cache_space=0.01, swap_space=0.01).create_engine_config()


def _readable(obj: Any) -> dict[str, Any]:
    """What reading each attribute of ``obj`` gives, where that is data."""
    out = {}
    names = [n for n in dir(obj) if not n.startswith("__")]
    names += list(getattr(obj, "attribute_map", {}) or {})
    for name in names:
        try:
            value = getattr(obj, name)
        except Exception:  # noqa: BLE001
            continue
        if not callable(value):
            out[name] = value
    return out


@pytest.mark.parametrize("arch", ["llama3_tied", "qwen3"])
def test_ranks_get_every_value_without_a_transformers_class(tmp_path: Path, arch: str) -> None:
    hf = make_config(arch)
    save_hf_model(hf, tmp_path)
    config = _engine_config(tmp_path)
    sent = config_for_ranks(config)
    values = sent.model_config.hf_config
    assert isinstance(values, HFConfigValues)
    original = _readable(config.model_config.hf_config)
    got = _readable(values)
    differ = {k: (v, got.get(k, "absent")) for k, v in original.items()
              if type(v).__module__.split(".")[0] != "transformers" and got.get(k, "absent") != v}
    assert not differ, differ
    assert sent.model_config.model == config.model_config.model
    assert sent.parallel_config == config.parallel_config

    class NoTransformers(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            assert module.split(".")[0] != "transformers", f"{module}.{name}"
            return super().find_class(module, name)

    assert isinstance(NoTransformers(io.BytesIO(pickle.dumps(sent))).load().model_config
                      .hf_config, HFConfigValues)

    # A rank's path in a fresh process: unpickle, build and load the model.
    (tmp_path / "sent.pkl").write_bytes(pickle.dumps(sent))
    got = run_python_json(f"""
import json, pickle, sys
from vllm_lite.models.loader import load_model
config = pickle.load(open({str(tmp_path / "sent.pkl")!r}, "rb"))
mc = config.model_config
model, _ = load_model(mc.model, mc.dtype, "cpu", mc.max_model_len, hf_config=mc.hf_config)
print(json.dumps({{"transformers": "transformers" in sys.modules,
                  "params": sum(p.numel() for p in model.parameters())}}))
""")
    assert got["transformers"] is False
    from vllm_lite.models.loader import load_model

    model, _ = load_model(tmp_path)
    assert got["params"] == sum(p.numel() for p in model.parameters())


def test_a_value_that_needs_transformers_sends_the_config_itself(tmp_path: Path) -> None:
    from transformers.utils import PaddingStrategy

    save_hf_model(make_config("llama"), tmp_path)
    config = _engine_config(tmp_path)
    hf = config.model_config.hf_config
    # A nested config becomes plain values too.
    hf.text_config = make_config("llama")
    nested = config_for_ranks(config).model_config.hf_config.text_config
    assert isinstance(nested, HFConfigValues)
    assert nested.num_attention_heads == hf.text_config.num_attention_heads
    # A plain list holding a transformers object, at the top or nested: the values would
    # import transformers, so the config itself is sent (never a config missing a value).
    hf.text_config.odd_setting = [PaddingStrategy.LONGEST]
    assert config_for_ranks(config) is config
    del hf.text_config
    hf.odd_setting = [PaddingStrategy.LONGEST]
    assert config_for_ranks(config) is config
