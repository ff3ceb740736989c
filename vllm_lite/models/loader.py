"""Loads a Hugging Face model folder (config.json + safetensors / pytorch_model.bin);
GGUF files and model aliases are first converted to such a folder (see
:mod:`vllm_lite.models.gguf`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_lite.config.schema import DEFAULT_MODEL
from vllm_lite.models.gguf import resolve_model
from vllm_lite.models.gptq_awq import dequantized_weights, read_spec
from vllm_lite.models.registry import get_model_class

__all__ = ["DEFAULT_MODEL", "check_folder_links", "check_model_memory", "estimate_model_bytes", "iterate_weights",
           "load_model", "read_hf_config", "resolve_dtype", "resolve_model"]

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


# config.json keys every supported (Llama-family) checkpoint must state: transformers would
# otherwise fill in its class defaults (a 7B Llama) for a file that lacks them.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size")
# Integer sizes that may be absent (or null) and then take a derived default.
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def _positive_int(config_file: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{config_file}: {key} must be a positive int, got {value!r}")
    return value


def _check_positive(config_file: Path, raw: dict, key: str, name: str | None = None) -> None:
    """A physical constant (rope base, norm epsilon, scaling factor), when given, must be a
    positive finite number: 0 or a negative one loads and then computes NaN or nonsense."""
    value = raw.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ValueError(f"{config_file}: {name or key} must be a positive number, "
                         f"got {value!r}")


def _check_config_dict(config_file: Path, raw: Any) -> None:
    """The shape fields of a config.json, checked before transformers interprets them
    (it raises assorted errors, or divides by zero, on bad ones)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in raw]
    if missing:
        raise ValueError(f"{config_file} lacks {', '.join(missing)}")
    for key in _REQUIRED_KEYS:
        _positive_int(config_file, key, raw[key])
    for key in _OPTIONAL_SIZES:
        if raw.get(key) is not None:
            _positive_int(config_file, key, raw[key])
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{config_file}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    if raw.get("head_dim") is None and raw["hidden_size"] % heads:
        raise ValueError(f"{config_file}: hidden_size {raw['hidden_size']} is not divisible by "
                         f"num_attention_heads {heads} (and no head_dim is given)")
    _check_positive(config_file, raw, "rms_norm_eps")
    _check_positive(config_file, raw, "rope_theta")
    for group in ("rope_scaling", "rope_parameters"):
        params = raw.get(group)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{config_file}: {group} must be an object, got {params!r}")
        for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"):
            _check_positive(config_file, params, key, f"{group}.{key}")
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        if low is not None and low == high:
            raise ValueError(f"{config_file}: {group}.low_freq_factor and high_freq_factor "
                             f"must differ (both {low!r})")


def read_hf_config(path: str | Path) -> Any:
    """The transformers config of the HF folder ``path``, after checking its config.json;
    every problem (unreadable or invalid JSON, a missing or non-positive size, heads that
    do not divide, a model type transformers does not know) is a ValueError."""
    config_file = Path(path) / "config.json"
    if Path(path).is_dir():
        check_folder_links(path)
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_file}: {e}") from None
    _check_config_dict(config_file, raw)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds for a bad file)
        raise ValueError(f"cannot load {config_file}: {type(e).__name__}: {e}") from None


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _mlp_params(config: Any) -> int:
    """A layer's feed-forward parameters: the dense SwiGLU MLP's, or a mixture of experts'
    (each expert's, the router's, a shared expert's), counted as if every layer had them."""
    hidden = config.hidden_size
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return 3 * hidden * config.intermediate_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    return experts * (3 * hidden * inter + hidden) + 3 * hidden * shared + hidden


def estimate_model_bytes(config: Any, dtype: torch.dtype, max_model_len: int | None = None) -> int:
    """Bytes the model's parameters and buffers take (within a few per cent): embeddings,
    the untied lm_head, per layer the QKV / output / MLP projections and norms, and the
    float32 rotary table. Computed with Python ints, so absurd sizes cannot overflow."""
    hidden, vocab = config.hidden_size, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = _head_dim(config)
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim  # fused QKV
                 + heads * head_dim * hidden                  # o_proj
                 + _mlp_params(config)                        # MLP or experts
                 + 2 * hidden + 2 * head_dim)                 # norms (q/k norms for Qwen3)
    params = vocab * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    params += config.num_hidden_layers * per_layer + hidden
    positions = max_model_len or getattr(config, "max_position_embeddings", None) or 2048
    rotary = positions * head_dim * 4
    return params * torch.empty((), dtype=dtype).element_size() + rotary


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new model may take on ``device`` now: MemAvailable on the CPU, the free
    device memory on CUDA; None when unknown."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001  (no usable CUDA: let the allocation say so)
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_model_memory(config: Any, dtype: torch.dtype, device: torch.device,
                       max_model_len: int | None = None, shards: int = 1,
                       copies: int = 1) -> int:
    """Refuse (ValueError) a model whose weights cannot fit the memory ``device`` has free,
    before anything is allocated; returns the estimated bytes (one rank's, when the model
    is split over ``shards`` tensor-parallel ranks; ``copies`` times the weights where a
    step holds them that often at once, as a GGUF conversion does)."""
    need = estimate_model_bytes(config, dtype, max_model_len) * copies // shards
    have = _available_bytes(device)
    if have is not None and need > have:
        raise ValueError(
            f"the model needs about {need / 2**30:.3g} GiB for its weights "
            f"(vocab_size {config.vocab_size}, hidden_size {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, {dtype}), more than the "
            f"{have / 2**30:.3g} GiB free on {device}"
        )
    return need


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
            return _indexed_files(folder, index), fmt
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"], "safetensors"
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if files:
        return files, "safetensors"
    files = sorted(folder.glob("pytorch_model*.bin"))
    if files:
        return files, "bin"
    raise ValueError(f"no weights in {folder}: expected *.safetensors or pytorch_model*.bin")


def _allowed_roots(folder: Path) -> list[Path]:
    """Where the files of ``folder`` may really live: the folder itself and, for a snapshot
    of the Hugging Face hub cache (``models--org--name/snapshots/<rev>/``, whose files are
    symlinks to ``../../blobs/<hash>``), that repository's blobs folder."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return any(real == r or r in real.parents for r in roots)


def check_folder_links(folder: str | Path) -> None:
    """Refuses (ValueError) a model or tokenizer folder holding a symlink that leads out of
    it: every file a load reads (config.json, weights, tokenizer files, chat template) is
    then one of the folder's own."""
    folder = Path(folder)
    roots = _allowed_roots(folder)
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise ValueError(f"cannot list the model folder {folder}: {e}") from None
    for entry in entries:
        if entry.is_symlink() and not _inside(entry, roots):
            raise ValueError(f"{entry} is a symlink to a file outside the model folder "
                             f"(to {entry.resolve()}); copy the file into the folder instead")


def _indexed_files(folder: Path, index: Path) -> list[Path]:
    """The shard files an index's weight_map names, each a plain file inside ``folder``:
    an absolute path, a ``..`` or a symlink leading out of the folder is refused."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the weight_map of {index}: {type(e).__name__}: {e}") \
            from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f for f in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    roots = _allowed_roots(folder)
    files = []
    for name in sorted(set(weight_map.values())):
        shard = (folder / name).resolve()  # follows symlinks and ".."
        if Path(name).is_absolute() or not _inside(folder / name, roots):
            raise ValueError(f"{index}: weight file {name!r} lies outside the model folder")
        if not shard.is_file():
            raise ValueError(f"{index}: weight file {name!r} does not exist")
        files.append(shard)
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one file at a time."""
    files, fmt = _weight_files(Path(folder))
    for path in files:
        # A truncated or corrupt file is bad input (ValueError), whatever the reader raises.
        if fmt == "safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    names = list(f.keys())
                    tensors = ((name, f.get_tensor(name)) for name in names)
                    yield from tensors
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...)
                raise ValueError(f"cannot read weights from {path}: {type(e).__name__}: {e}") \
                    from None
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001  (UnpicklingError, RuntimeError, ...)
                raise ValueError(f"cannot read weights from {path}: {type(e).__name__}: {e}") \
                    from None
            yield from state.items()
            del state


def _floating_point(weights: Iterator[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, each checked to be floating point: an integer or bool tensor where the
    model takes floats would otherwise be cast into nonsense without a word. (Quantized
    GPTQ / AWQ tensors arrive here already dequantized; floating formats of other widths,
    float64 or float8, are cast to the model's dtype.)"""
    for name, tensor in weights:
        if not tensor.is_floating_point():
            raise ValueError(f"weight {name} is stored as {tensor.dtype}; the model's weights "
                             "must be floating point (float32, float16, bfloat16, ...) or a "
                             "quantized checkpoint format (GPTQ, AWQ, GGUF)")
        yield name, tensor


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    tp: Any = None,
    hf_config: Any = None,
) -> tuple[nn.Module, Any]:
    """Builds the model named by ``path``/config.json and loads its weights.

    ``path``: an HF model folder, a ``.gguf`` file, a folder holding one, or an alias
    such as ``"smollm2-135m"`` (:data:`DEFAULT_MODEL`); GGUF checkpoints are converted
    once into a cache folder (:func:`resolve_model`), which later loads read directly.
    ``tp``: a :class:`~vllm_lite.distributed.group.TensorParallelGroup` to build and load
    only this rank's shards. ``hf_config``: the config the engine already read and checked
    from that folder (a tensor-parallel rank gets it as plain values and so never imports
    transformers); None reads config.json. Returns ``(model, hf_config)``, the model in
    eval mode on ``device`` in ``dtype`` (the rotary table stays float32). Local files
    only: nothing is downloaded.
    Raises ValueError for an unknown alias or missing path, a missing package, a bad
    config.json (see :func:`read_hf_config`), a model too big for the free memory of
    ``device`` (checked before allocating), an unsupported architecture, an index naming
    files outside the folder, an unreadable weight file, or missing / unexpected /
    mis-shaped weights.
    """
    path = resolve_model(path)
    config = read_hf_config(path) if hf_config is None else hf_config
    model_cls = get_model_class(getattr(config, "architectures", None))
    # The architecture's own settings (MoE routing, GLM's rotary) before sizes are used.
    model_cls.check_config(config)
    torch_dtype = resolve_dtype(dtype, config)
    check_model_memory(config, torch_dtype, torch.device(device), max_model_len,
                       1 if tp is None else tp.size)
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config, max_model_len=max_model_len, tp=tp) if tp is not None \
            else model_cls(config, max_model_len=max_model_len)
    weights = iterate_weights(path)
    spec = read_spec(path)
    if spec is not None:
        # A GPTQ / AWQ checkpoint: the float model gets its weights dequantized; the worker
        # then swaps in the exact 4-bit layers (quantization="gptq" / "awq").
        weights = dequantized_weights(weights, spec)
    model.load_weights(_floating_point(weights))
    model.eval()
    # The worker says in one line what runs (dtype and quantization together).
    logger.debug("loaded %s from %s (%s, %s)", model_cls.__name__, path, torch_dtype, device)
    return model, config
