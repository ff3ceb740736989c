"""Decode steps through ops.llama_decode_layers (every decoder layer in one native call,
csrc/cpu/decode_layers.cpp): the engine's greedy tokens and their logprobs are the same
bits as through the layers' own forward, for every model family, both CPU dtypes and the
float / int8 / int4 projections; the
call happens exactly where every layer qualifies (not Qwen3's q/k norms, not with forward
hooks); paged attention v2 (long contexts) too; bad lists are named errors."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from models.helpers import BASE, CONFIG_NAMES, make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams, ops  # noqa: E402


def _needs_packed(dtype: torch.dtype) -> None:
    if not ops.packed_linear_kernel_selected(dtype):
        pytest.skip(f"no packed_linear kernel for {dtype} in the selected CPU build: the "
                    "layers are not packed, so decode steps never take the one-call path")


def _generate(llm: LLM, prompts: list[list[int]], fused: bool, max_tokens: int,
              calls: list[int]) -> list[tuple[list[int], list[float]]]:
    llm.llm_engine.model.model.fused_decode = fused
    before = calls[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append((list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs]))
    if not fused:
        assert calls[0] == before  # switched off: the layers' own path
    return got


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = ops.llama_decode_layers

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "llama_decode_layers", counting)
    return calls


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_one_call_decode_matches_the_layers_bit_for_bit(
        name: str, dtype: str, quantization: str, tmp_path: Path, counted: list[int]) -> None:
    if quantization == "none":
        _needs_packed(getattr(torch, dtype))
    save_hf_model(make_config(name), tmp_path, seed=random.randrange(1 << 30))
    llm = LLM(str(tmp_path), dtype=dtype, device="cpu", block_size=4, kv_cache_space=0.02,
              swap_space=0, quantization=quantization,
              quantization_group_size=32 if quantization == "int4" else None)
    rng = random.Random()
    prompts = [[rng.randrange(BASE["vocab_size"]) for _ in range(rng.randint(1, 40))]
               for _ in range(5)]
    # Float weights: gate_up packed gated (packed_gated_linear on both paths); quantized
    # ones: gate_up then silu_and_mul.
    mlp = llm.llm_engine.model.model.layers[0].mlp
    assert getattr(mlp.gate_up_proj, "gated_packed", False) == (quantization == "none")
    fused = _generate(llm, prompts, True, 12, counted)
    calls = counted[0]
    plain = _generate(llm, prompts, False, 12, counted)
    assert fused == plain
    if name == "qwen3":
        assert calls == 0  # per-head q/k norms: the layers' own path
    else:
        assert calls >= 11  # every decode step (the first token comes from the prefill)


def test_one_call_decode_with_paged_attention_v2(tmp_path: Path, counted: list[int]) -> None:
    # Contexts past one 512-token partition with few sequences: ops.use_v2 picks v2.
    _needs_packed(torch.float32)
    config = make_config("llama")
    config.max_position_embeddings = 1024
    save_hf_model(config, tmp_path, seed=random.randrange(1 << 30))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=16,
              kv_cache_space=0.05, swap_space=0)
    rng = random.Random()
    prompts = [[rng.randrange(BASE["vocab_size"]) for _ in range(rng.randint(520, 700))]
               for _ in range(2)]
    assert ops.use_v2(700, 2, config.num_attention_heads)
    fused = _generate(llm, prompts, True, 6, counted)
    assert counted[0] >= 5
    assert fused == _generate(llm, prompts, False, 6, counted)


def test_one_call_decode_on_the_flash_layout(tmp_path: Path, counted: list[int]) -> None:
    """kv_cache_layout="flash": the one call writes with reshape_and_cache_flash and
    attends over the 4-D caches, bit for bit as the layers' own path (int8 weights: the
    one call takes them on every CPU build)."""
    save_hf_model(make_config("llama"), tmp_path, seed=random.randrange(1 << 30))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4, kv_cache_space=0.02,
              swap_space=0, quantization="int8", kv_cache_layout="flash")
    assert llm.llm_engine.cache_engine.gpu_cache[0][0].dim() == 4
    rng = random.Random()
    prompts = [[rng.randrange(BASE["vocab_size"]) for _ in range(rng.randint(1, 40))]
               for _ in range(4)]
    fused = _generate(llm, prompts, True, 10, counted)
    assert counted[0] >= 9
    assert fused == _generate(llm, prompts, False, 10, counted)


def test_forward_hooks_take_the_layers_path(tmp_path: Path, counted: list[int]) -> None:
    _needs_packed(torch.float32)
    save_hf_model(make_config("llama"), tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4, kv_cache_space=0.02,
              swap_space=0)
    seen = []
    mlp = llm.llm_engine.model.model.layers[0].mlp
    handle = mlp.register_forward_hook(lambda *args: seen.append(1))
    try:
        _generate(llm, [[1, 2, 3]], True, 4, counted)
    finally:
        handle.remove()
    assert counted[0] == 0 and len(seen) == 4  # the hook saw the prefill and 3 decodes


def test_bad_lists_are_named_errors() -> None:
    t, width, heads, kv_heads, head = 2, 8, 2, 1, 4
    hidden = torch.randn(t, width)
    kc, vc = (torch.zeros(s) for s in ops.kv_cache_shapes(4, kv_heads, head, 4, torch.float32))
    common = dict(positions=torch.zeros(t, dtype=torch.long),
                  intermediate_size=8, gated_mlp=False, cos_sin_cache=torch.zeros(16, head),
                  slot_mapping=torch.arange(t), block_tables=torch.zeros(t, 1, dtype=torch.int32),
                  seq_lens=torch.ones(t, dtype=torch.int32), block_size=4, max_seq_len=1,
                  num_heads=heads, num_kv_heads=kv_heads, head_size=head, scale=0.5,
                  kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, epsilon=1e-6)
    good = dict(norm_weights=[torch.ones(width)] * 2, weights=[torch.zeros(1, width, 48)] * 4,
                scales=[None] * 4, zeros=[None] * 4, group_sizes=[0] * 4, biases=[None] * 4,
                key_caches=[kc], value_caches=[vc])
    cases = [({**good, "norm_weights": good["norm_weights"][:1]},
              "norm_weights must hold 2 per layer")]
    for name in ("weights", "scales", "zeros", "group_sizes", "biases"):
        cases.append(({**good, name: good[name][:3]}, f"{name} must hold 4 per layer"))
    cases += [({**good, "value_caches": []}, "value_caches has 0 layers"),
              ({name: [] for name in good}, "no layers")]
    # gated_mlp with a quantized (scaled) gate_up projection
    quant = {**good, "scales": [None, None, torch.ones(8), None]}
    cases.append(({**quant, "gated_mlp": True}, "gated_mlp needs float gate_up weights"))
    for lists, message in cases:
        before = hidden.clone()
        with pytest.raises(RuntimeError, match=message):
            ops.llama_decode_layers(hidden, torch.empty_like(hidden), **{**common, **lists})
        assert torch.equal(hidden, before)  # refused before anything ran


def test_new_weights_after_prepare_for_cpu_are_used(tmp_path: Path, counted: list[int]) -> None:
    # The op's arguments are gathered once; changing weights and re-packing them
    # (prepare_for_cpu, as load_weights does) must reach the next decode step.
    _needs_packed(torch.float32)
    save_hf_model(make_config("llama"), tmp_path, seed=random.randrange(1 << 30))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4, kv_cache_space=0.02,
              swap_space=0)
    prompts = [[5, 9, 17, 33], [2, 4]]
    before = _generate(llm, prompts, True, 8, counted)
    model = llm.llm_engine.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    model.prepare_for_cpu()
    calls = counted[0]
    fused = _generate(llm, prompts, True, 8, counted)
    assert counted[0] > calls
    assert fused == _generate(llm, prompts, False, 8, counted)
    assert fused != before  # the change mattered
