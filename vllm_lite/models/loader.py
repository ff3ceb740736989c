"""Loads a Hugging Face model folder (config.json + safetensors / pytorch_model.bin);
GGUF files and model aliases are first converted to such a folder (see
:mod:`vllm_lite.models.gguf`)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_lite.models.gguf import DEFAULT_MODEL, resolve_model
from vllm_lite.models.registry import get_model_class

__all__ = ["DEFAULT_MODEL", "iterate_weights", "load_model", "resolve_dtype", "resolve_model"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str, config: Any) -> torch.dtype:
    """A torch dtype from a dtype or a name; "auto" takes the checkpoint's dtype
    (``config.dtype`` / ``config.torch_dtype``), float32 when it names none."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        resolved = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} not supported; use float32, float16, bfloat16 or auto")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {resolved} not supported; use float32, float16 or bfloat16")
    return resolved


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Build the parameters directly in the target dtype (no float32 copy of a big model).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _weight_files(folder: Path) -> tuple[list[Path], str]:
    """The checkpoint files and their format ("safetensors" or "bin").

    An index file, when present, names the shards; this matters for Mistral repos, which
    also ship a ``consolidated.safetensors`` in the original (non-HF) naming.
    """
    for index_name, fmt in (("model.safetensors.index.json", "safetensors"),
                            ("pytorch_model.bin.index.json", "bin")):
        index = folder / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / f for f in sorted(set(weight_map.values()))], fmt
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"], "safetensors"
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if files:
        return files, "safetensors"
    files = sorted(folder.glob("pytorch_model*.bin"))
    if files:
        return files, "bin"
    raise ValueError(f"no weights in {folder}: expected *.safetensors or pytorch_model*.bin")


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one file at a time."""
    files, fmt = _weight_files(Path(folder))
    for path in files:
        if fmt == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
) -> tuple[nn.Module, Any]:
    """Builds the model named by ``path``/config.json and loads its weights.

    ``path``: an HF model folder, a ``.gguf`` file, a folder holding one, or an alias
    such as ``"smollm2-135m"`` (:data:`DEFAULT_MODEL`); GGUF checkpoints are converted
    once into a cache folder (:func:`resolve_model`), which later loads read directly.
    Returns ``(model, hf_config)``, the model in eval mode on ``device`` in ``dtype``
    (the rotary table stays float32). Local files only: nothing is downloaded.
    Raises ValueError for an unknown alias or missing path, a missing package, an
    unsupported architecture, or missing / unexpected / mis-shaped weights.
    """
    path = resolve_model(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model_cls = get_model_class(getattr(config, "architectures", None))
    torch_dtype = resolve_dtype(dtype, config)
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config, max_model_len=max_model_len)
    model.load_weights(iterate_weights(path))
    model.eval()
    logger.info("loaded %s from %s (%s, %s)", model_cls.__name__, path, torch_dtype, device)
    return model, config
