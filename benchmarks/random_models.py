"""Random-weight models of named shapes (``--random-model NAME``): what a benchmark runs
when the shape matters and no checkpoint of it fits these machines.

A model is built from its transformers config with seeded random weights, its routers
scaled up so that tokens spread over the experts (HF initialises weights with std
``initializer_range``; a near-uniform router would be unlike a trained one), and saved
once as a Hugging Face folder under ``$VLLM_LITE_CACHE/random-models/<name>-seed<seed>``;
later runs load that folder. Every engine then reads the same folder, in the benchmark's
dtype.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: name -> (transformers config class, its arguments, what the shape resembles).
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "moe-16x1024": (
        "MixtralConfig",
        dict(vocab_size=49155, hidden_size=1024, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, num_local_experts=16,
             num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=True,
             rms_norm_eps=1e-6),
        "a Mixtral (top-2 routing, GQA) of 16 experts at the width of IBM's "
        "Granite-3.0-1B-A400M MoE (hidden 1024, 16 heads, 8 KV heads, experts 512 wide, "
        "vocabulary 49155, tied embeddings), 4 layers instead of its 24",
    ),
}


def describe(name: str) -> str:
    cls, kw, resembles = SHAPES[name]
    return (f"random-weight {cls.removesuffix('Config')} '{name}' ({resembles}; "
            f"{parameter_count(name) / 1e6:.0f}M parameters)")


def parameter_count(name: str) -> int:
    """Parameters of the shape (embeddings counted once when tied)."""
    _, c, _ = SHAPES[name]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    head = h // c["num_attention_heads"]
    attn = h * head * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    experts = c.get("num_local_experts", c.get("num_experts", 0))
    ffn = experts * 3 * h * c["intermediate_size"] + experts * h
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return layers * (attn + ffn + 2 * h) + embed + h


def _cache_root() -> Path:
    env = os.environ.get("VLLM_LITE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_lite"
    return root / "random-models"


def materialize(name: str, seed: int = 0) -> Path:
    """The folder of the random model ``name`` (ValueError for an unknown name), written
    on first use (to a temporary folder renamed into place, so a crash leaves none)."""
    import torch
    import transformers

    if name not in SHAPES:
        raise ValueError(f"--random-model {name!r} is not a known shape; known: "
                         f"{', '.join(sorted(SHAPES))}")
    cls, kw, _ = SHAPES[name]
    folder = _cache_root() / f"{name}-seed{seed}"
    if (folder / "config.json").is_file():
        stored = json.loads((folder / "config.json").read_text())
        if all(stored.get(k) == v for k, v in kw.items()):
            return folder
        shutil.rmtree(folder)  # the shape changed since it was written
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing the %s to %s", describe(name), folder)
    config = getattr(transformers, cls)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 * 4)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
