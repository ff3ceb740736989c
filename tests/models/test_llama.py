"""Llama-family models and the loader against Hugging Face transformers (float32)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from .helpers import (  # noqa: E402
    CONFIG_NAMES,
    PagedCache,
    hf_logits,
    make_config,
    make_step,
    save_hf_model,
)
from vllm_lite.layers.attention import (  # noqa: E402
    AttentionMetadata,
    attention_metadata,
)
from vllm_lite.models import get_model_class, load_model, supported_architectures  # noqa: E402

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(scope="module", params=CONFIG_NAMES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, HF model) for each tiny config, saved once per module."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    hf_model = save_hf_model(make_config(name), folder)
    return name, folder, hf_model


def _run(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
         meta: AttentionMetadata) -> torch.Tensor:
    with torch.no_grad(), attention_metadata(meta):
        return model.compute_logits(model(ids, positions))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float = ATOL) -> None:
    assert ours.dtype == torch.float32
    assert not torch.isnan(ours).any(), f"{what}: NaN (read an unwritten cache slot?)"
    torch.testing.assert_close(ours.cpu(), ref.cpu(), atol=tol, rtol=RTOL,
                               msg=lambda m: f"{what}: {m}")


def test_prefill_then_decode_matches_hf(checkpoint: tuple[str, Path, Any]) -> None:
    name, folder, hf_model = checkpoint
    model, config = load_model(folder)
    assert type(model).__name__ == config.architectures[0]
    gen = torch.Generator().manual_seed(1)
    prompt_lens, decode_steps = [5, 11, 8], 4
    full = [torch.randint(0, config.vocab_size, (n + decode_steps,), generator=gen)
            for n in prompt_lens]
    refs = [hf_logits(hf_model, t) for t in full]
    cache = PagedCache(model, num_blocks=48, block_size=4)

    # Prefill: the three prompts flattened into one batch.
    ids, pos, meta = make_step(cache, [(i, full[i][:n], 0) for i, n in enumerate(prompt_lens)],
                               is_prompt=True)
    logits = _run(model, ids, pos, meta)
    _assert_close(logits, torch.cat([refs[i][:n] for i, n in enumerate(prompt_lens)]),
                  f"{name} prefill")

    # Decode: one token per sequence through the paged-attention kernel.
    for step in range(decode_steps):
        seqs = [(i, full[i][: n + step + 1], n + step) for i, n in enumerate(prompt_lens)]
        ids, pos, meta = make_step(cache, seqs, is_prompt=False)
        logits = _run(model, ids, pos, meta)
        _assert_close(logits, torch.stack([refs[i][n + step] for i, n in enumerate(prompt_lens)]),
                      f"{name} decode step {step}")


def test_prefix_and_chunked_prefill_match_hf(checkpoint: tuple[str, Path, Any]) -> None:
    """Prefill over a cached prefix: a prefix-cache hit (shared full blocks) and the second
    chunk of a chunked prefill (prefix ending mid-block), batched with a fresh prompt and
    followed by decodes."""
    name, folder, hf_model = checkpoint
    model, config = load_model(folder)
    gen = torch.Generator().manual_seed(2)
    vocab = config.vocab_size
    a = torch.randint(0, vocab, (10,), generator=gen)
    b = torch.cat((a[:8], torch.randint(0, vocab, (6 + 2,), generator=gen)))  # shares 2 blocks
    c = torch.randint(0, vocab, (7 + 2,), generator=gen)
    d = torch.randint(0, vocab, (11 + 2,), generator=gen)
    ref = {k: hf_logits(hf_model, t) for k, t in dict(a=a, b=b, c=c, d=d).items()}
    cache = PagedCache(model, num_blocks=40, block_size=4, seed=3)

    # Step 1: all of A, the first 5 tokens of D.
    ids, pos, meta = make_step(cache, [(0, a, 0), (3, d[:5], 0)], is_prompt=True)
    logits = _run(model, ids, pos, meta)
    _assert_close(logits, torch.cat((ref["a"], ref["d"][:5])), f"{name} step 1")

    # Step 2: B over A's first two blocks, C fresh, D's remaining 6 tokens.
    cache.share_prefix(1, parent=0, num_blocks=2)
    ids, pos, meta = make_step(cache, [(1, b[:14], 8), (2, c[:7], 0), (3, d[:11], 5)],
                               is_prompt=True)
    logits = _run(model, ids, pos, meta)
    _assert_close(logits, torch.cat((ref["b"][8:14], ref["c"][:7], ref["d"][5:11])),
                  f"{name} prefix/chunked prefill")

    for step in range(2):
        seqs = [(1, b[: 15 + step], 14 + step), (2, c[: 8 + step], 7 + step),
                (3, d[: 12 + step], 11 + step)]
        ids, pos, meta = make_step(cache, seqs, is_prompt=False)
        logits = _run(model, ids, pos, meta)
        expected = torch.stack((ref["b"][14 + step], ref["c"][7 + step], ref["d"][11 + step]))
        _assert_close(logits, expected, f"{name} decode after prefix, step {step}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_then_decode_on_cuda(tmp_path: Path) -> None:
    """The same flow on the GPU (CUDA kernels, SDPA on CUDA); looser float32 tolerance
    since CUDA SDPA and GEMMs reduce in a different order."""
    hf_model = save_hf_model(make_config("qwen3"), tmp_path)
    model, config = load_model(tmp_path, device="cuda")
    gen = torch.Generator().manual_seed(6)
    full = [torch.randint(0, config.vocab_size, (n + 2,), generator=gen) for n in (6, 13)]
    refs = [hf_logits(hf_model, t) for t in full]
    cache = PagedCache(model, num_blocks=16, block_size=8, device="cuda")
    ids, pos, meta = make_step(cache, [(0, full[0][:6], 0), (1, full[1][:13], 0)], True)
    _assert_close(_run(model, ids, pos, meta), torch.cat((refs[0][:6], refs[1][:13])),
                  "cuda prefill", tol=1e-3)
    for step in range(2):
        ids, pos, meta = make_step(cache, [(0, full[0][: 7 + step], 6 + step),
                                           (1, full[1][: 14 + step], 13 + step)], False)
        _assert_close(_run(model, ids, pos, meta),
                      torch.stack((refs[0][6 + step], refs[1][13 + step])),
                      f"cuda decode {step}", tol=1e-3)


def test_prefill_without_cache(tmp_path: Path) -> None:
    """k_cache/v_cache None: pure prefill, nothing cached (and a decode is refused)."""
    hf_model = save_hf_model(make_config("qwen3"), tmp_path)
    model, _ = load_model(tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 160, (n,), generator=gen) for n in (3, 9)]
    meta = AttentionMetadata(
        is_prompt=True,
        slot_mapping=torch.full((12,), -1, dtype=torch.int64),
        seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 12], dtype=torch.int32),
        block_tables=torch.zeros((2, 0), dtype=torch.int32),
        max_seq_len=9,
        block_size=16,
    )
    logits = _run(model, torch.cat(prompts), torch.cat([torch.arange(3), torch.arange(9)]), meta)
    _assert_close(logits, torch.cat([hf_logits(hf_model, p) for p in prompts]), "no-cache prefill")
    meta.is_prompt = False
    with pytest.raises(RuntimeError, match="KV cache"):
        _run(model, torch.cat(prompts)[:2], torch.tensor([2, 8]), meta)


def test_forward_without_metadata_is_an_error(tmp_path: Path) -> None:
    save_hf_model(make_config("llama"), tmp_path)
    model, _ = load_model(tmp_path)
    with pytest.raises(RuntimeError, match="set_attention_metadata"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]))


def test_bfloat16_load_and_paged_decode(tmp_path: Path) -> None:
    """dtype=bfloat16: parameters and cache in bf16 (rotary table kept float32); logits
    track the float32 reference within bf16 rounding."""
    hf_model = save_hf_model(make_config("llama3_tied"), tmp_path)
    model, config = load_model(tmp_path, dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.cos_sin_cache.dtype == torch.float32
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (14,), generator=gen)
    ref = hf_logits(hf_model, tokens)
    cache = PagedCache(model, num_blocks=8, block_size=4, dtype=torch.bfloat16)
    ids, pos, meta = make_step(cache, [(0, tokens[:12], 0)], is_prompt=True)
    logits = _run(model, ids, pos, meta)
    tol = 0.05 * ref.abs().max().item()
    assert (logits - ref[:12]).abs().max().item() < tol
    for step in range(2):
        ids, pos, meta = make_step(cache, [(0, tokens[: 13 + step], 12 + step)], is_prompt=False)
        logits = _run(model, ids, pos, meta)
        assert (logits[0] - ref[12 + step]).abs().max().item() < tol


def test_rotary_matches_hf_for_each_rope_type() -> None:
    """Our cos/sin table against HF's rotary module, including dynamic NTK (which equals
    the default rotary within max_position_embeddings)."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from vllm_lite.layers.rotary import RotaryEmbedding, rope_parameters_of

    scalings = [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ]
    for scaling in scalings:
        cfg = tf.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                             rope_scaling=scaling)
        hf = LlamaRotaryEmbedding(cfg)
        ours = RotaryEmbedding(32, 256, rope_parameters_of(cfg))
        positions = torch.tensor([0, 1, 7, 63, 64, 200, 255])
        x = torch.randn(7, 2, 32)
        cos, sin = hf(x, positions[None])
        q_ref = x * cos[0][:, None] + torch.cat((-x[..., 16:], x[..., :16]), -1) * sin[0][:, None]
        q, k = x.clone(), x[:, :1].clone()
        ours(positions, q, k)  # in place
        torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k, q_ref[:, :1], atol=1e-6, rtol=1e-6)


def test_unsupported_rope_type_is_rejected() -> None:
    from vllm_lite.layers.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match="llama3"):
        RotaryEmbedding(16, 32, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})


def test_pytorch_model_bin_checkpoint(tmp_path: Path) -> None:
    config = make_config("qwen2")
    hf_model = save_hf_model(config, tmp_path / "st")
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(hf_model.state_dict(), folder / "pytorch_model.bin")
    model, _ = load_model(folder)
    tokens = torch.arange(6) + 3
    meta = AttentionMetadata(True, torch.full((6,), -1), torch.tensor([6], dtype=torch.int32),
                             torch.tensor([0, 6], dtype=torch.int32),
                             torch.zeros((1, 0), dtype=torch.int32), 6, 16)
    _assert_close(_run(model, tokens, torch.arange(6), meta), hf_logits(hf_model, tokens), "bin")


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    assert "LlamaForCausalLM" in supported_architectures()
    save_hf_model(make_config("llama"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*LlamaForCausalLM"):
        load_model(tmp_path)


def _edit_checkpoint(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_weights(tmp_path: Path) -> None:
    save_hf_model(make_config("llama"), tmp_path)
    _edit_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(tmp_path)

    save_hf_model(make_config("llama"), tmp_path)
    _edit_checkpoint(tmp_path, lambda t: t.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected.*extra"):
        load_model(tmp_path)

    save_hf_model(make_config("llama"), tmp_path)
    _edit_checkpoint(tmp_path, lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(ValueError, match="up_proj.weight: checkpoint shape"):
        load_model(tmp_path)


def test_gguf_and_non_model_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF file .* does not exist"):
        load_model(tmp_path / "model.gguf")  # GGUF loading itself: tests/models/test_gguf.py
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_sliding_window_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import transformers as tf

    from vllm_lite.models import MistralForCausalLM

    with caplog.at_level(logging.WARNING, logger="vllm_lite.models.llama"):
        model = MistralForCausalLM(tf.MistralConfig(**{**make_config("llama").to_dict(),
                                                       "sliding_window": 32}))
    assert model.sliding_window == 32
    assert "sliding_window=32" in caplog.text
