"""GLM, GLM-4 and the mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
against Hugging Face transformers in float32: logits step by step (prefill, paged decode,
prefix-cache hits, chunked prefill), LLM.generate's greedy tokens (also under preemption
and with prefix caching, and over two tensor-parallel ranks), bf16 / fp16 within rounding,
the MoE block against a float64 reference, and MoE settings the engine refuses at load,
before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from .helpers import (  # noqa: E402
    GLM_MOE_CONFIG_NAMES,
    assert_all_free,
    hf_greedy,
    hf_logits,
    make_glm_moe_config,
    make_hf_model,
    save_hf_model,
)
# The Llama-family model tests, run here over these configs (they take `checkpoint`).
from .test_llama import (  # noqa: E402,F401
    _assert_close,
    _run,
    test_prefill_then_decode_matches_hf,
    test_prefix_and_chunked_prefill_match_hf,
)
from vllm_lite.layers.attention import AttentionMetadata  # noqa: E402
from vllm_lite.layers.moe import MAX_NUM_EXPERTS, fused_moe  # noqa: E402
from vllm_lite.models import load_model  # noqa: E402


@pytest.fixture(scope="module", params=GLM_MOE_CONFIG_NAMES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, HF model) for each tiny config, saved once per module."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    hf_model = save_hf_model(make_glm_moe_config(name), folder)
    return name, folder, hf_model


# -- LLM.generate's greedy tokens ------------------------------------------------------------
PROMPT_LENS = [3, 9, 17, 30]
MAX_TOKENS = 10


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 160, (n,), generator=gen).tolist() for n in PROMPT_LENS]


VARIANTS = {
    "default": {},
    "preempt_recompute": dict(num_gpu_blocks_override=14, preemption_mode="recompute"),
    "prefix_caching": dict(enable_prefix_caching=True),
    "preempt_swap": pytest.param(dict(num_gpu_blocks_override=14, preemption_mode="swap"),
                                 marks=pytest.mark.full_grid),
    "chunked_prefill": pytest.param(dict(enable_chunked_prefill=True,
                                         max_num_batched_tokens=8, max_num_seqs=4),
                                    marks=pytest.mark.full_grid),
}


@pytest.fixture(scope="module")
def greedy_refs(checkpoint) -> list[list[int]]:
    _, _, hf_model = checkpoint
    return [hf_greedy(hf_model, p, MAX_TOKENS) for p in _prompts()]


@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_greedy_generate_matches_hf(checkpoint, greedy_refs, variant) -> None:
    from vllm_lite import LLM, SamplingParams

    _, folder, _ = checkpoint
    kw = dict(block_size=4, kv_cache_space=0.01, swap_space=0.01, **variant)
    llm = LLM(str(folder), dtype="float32", device="cpu", **kw)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_refs
    if "preemption_mode" in variant:
        assert llm.llm_engine.scheduler.num_preemptions[variant["preemption_mode"]] > 0
    assert_all_free(llm)


def test_prefix_cache_hits_generate_like_hf(checkpoint) -> None:
    from vllm_lite import LLM, SamplingParams

    _, folder, hf_model = checkpoint
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 160, (13,), generator=gen).tolist()
    prompts = [prefix + torch.randint(1, 160, (n,), generator=gen).tolist() for n in (2, 5, 7)]
    refs = [hf_greedy(hf_model, p, 6) for p in prompts]
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4, kv_cache_space=0.01,
              swap_space=0.01, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.prefix_cache_stats.hits > 0
    assert [o.outputs[0].token_ids for o in first + rest] == refs
    assert_all_free(llm)


# -- checkpoint layouts --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_expert_tensors_load(tmp_path: Path, name: str) -> None:
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) as a pytorch_model.bin loads like the per-expert safetensors."""
    config = make_glm_moe_config(name)
    hf_model = save_hf_model(config, tmp_path / "st")
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    state = hf_model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    torch.save(state, folder / "pytorch_model.bin")
    model, _ = load_model(folder)
    tokens = torch.arange(9) + 3
    meta = AttentionMetadata(True, torch.full((9,), -1), torch.tensor([9], dtype=torch.int32),
                             torch.tensor([0, 9], dtype=torch.int32),
                             torch.zeros((1, 0), dtype=torch.int32), 9, 16)
    _assert_close(_run(model, tokens, torch.arange(9), meta), hf_logits(hf_model, tokens),
                  f"{name} fused experts")


def test_missing_expert_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_hf_model(make_glm_moe_config("mixtral"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    missing = r"missing.*layers\.1\.mlp\.experts\.w13_weight\[\(5, 1\)\]"
    with pytest.raises(ValueError, match=missing):
        load_model(tmp_path)


# -- the MoE block against float64 ---------------------------------------------------------
def _reference_moe(hidden, logits, w13, w2, top_k, renormalize) -> torch.Tensor:
    """Token by token in float64: softmax, top-k, (renormalise), sum of weighted experts."""
    h, w13, w2 = hidden.double(), w13.double(), w2.double()
    probs = torch.softmax(logits.double(), dim=-1)
    out = torch.zeros_like(h)
    inter = w13.shape[1] // 2
    for t in range(h.shape[0]):
        weights, ids = torch.topk(probs[t], top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            proj = w13[e] @ h[t]
            act = torch.nn.functional.silu(proj[:inter]) * proj[inter:]
            out[t] += w * (w2[e] @ act)
    return out


def _separated_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits whose order is unambiguous (distinct by >= 0.05): float32 and float64
    pick the same top-k."""
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    return ranks.float() * 0.05 + 0.02 * torch.rand(tokens, experts, generator=gen)


MOE_CASES = [
    # (experts, top_k, tokens)
    (4, 1, 1), (8, 2, 7), (64, 8, 33), (16, 4, 300),
    pytest.param(4, 4, 4096, marks=pytest.mark.full_grid),
    pytest.param(64, 1, 4096, marks=pytest.mark.full_grid),
    pytest.param(64, 8, 1, marks=pytest.mark.full_grid),
    pytest.param(32, 2, 1000, marks=pytest.mark.full_grid),
]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k,tokens", MOE_CASES)
def test_fused_moe_matches_float64(experts: int, top_k: int, tokens: int,
                                   renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(experts * 1000 + top_k * 10 + tokens)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = _separated_logits(tokens, experts, gen)
    chosen = torch.topk(logits, top_k, dim=-1).indices.unique()
    idle = torch.ones(experts, dtype=torch.bool)
    idle[chosen] = False
    # An expert no token chose is never read: NaN weights there must not reach the output.
    w13[idle] = float("nan")
    w2[idle] = float("nan")
    out = fused_moe(x, logits, w13, w2, top_k, renormalize)
    assert out.dtype == torch.float32 and out.shape == (tokens, hidden)
    ref = _reference_moe(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if experts > top_k * tokens:
        assert idle.any()  # the case covers idle experts


def test_fused_moe_bfloat16_and_empty() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 32, generator=gen)
    w13 = torch.randn(8, 48, 32, generator=gen) / 32**0.5
    w2 = torch.randn(8, 32, 24, generator=gen) / 24**0.5
    logits = _separated_logits(50, 8, gen)
    ref = _reference_moe(x.bfloat16(), logits, w13.bfloat16(), w2.bfloat16(), 2, True)
    out = fused_moe(x.bfloat16(), logits.bfloat16(), w13.bfloat16(), w2.bfloat16(), 2, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.02)
    empty = fused_moe(x[:0], logits[:0], w13, w2, 2, True)
    assert empty.shape == (0, 32)


# -- refused settings ----------------------------------------------------------------------
BAD_SETTINGS = {
    "top_k_above_experts": ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    "too_many_experts": ("qwen3_moe", {"num_experts": MAX_NUM_EXPERTS + 1}, "num_experts"),
    "unknown_router_normalisation": ("olmoe", {"scoring_func": "sigmoid"}, "scoring_func"),
    "not_silu": ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    "dense_layer_out_of_range": ("qwen2_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
    "glm_rotary_too_small": ("glm", {"rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.01}},
                             "partial_rotary_factor"),
}


ARCHITECTURES = {"glm": "GlmForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM"}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_uncovered_settings_fail_at_load_naming_the_field(tmp_path: Path, case: str) -> None:
    """The config's field is named before any weight is read (the weight file here is not
    a checkpoint at all), by load_model and by the engine's config resolution."""
    from vllm_lite.config import EngineArgs

    name, edit, field = BAD_SETTINGS[case]
    make_glm_moe_config(name).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if "num_experts" in edit:  # transformers writes it as num_local_experts, which wins
        cfg.pop("num_local_experts", None)
    cfg.update(edit, architectures=[ARCHITECTURES[name]])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=field):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def test_glm_rotary_is_partial_and_interleaved() -> None:
    """The table and the layout GLM's config asks for (a Llama rotary would differ)."""
    from vllm_lite.models import GlmForCausalLM

    model = GlmForCausalLM(make_glm_moe_config("glm"))
    rotary = model.model.rotary_emb
    assert (rotary.head_size, rotary.rotary_dim, rotary.is_neox) == (16, 8, False)
    assert rotary.cos_sin_cache.shape == (256, 8)
    # Not the one-call decode path, which rotates whole heads in rotate_half pairs.
    assert model.model.layers[0].decode_parts(torch.float32) is None


def test_hf_model_helper_randomizes_routers() -> None:
    """The routers route (HF may initialize them to zero, where every expert ties)."""
    hf = make_hf_model(make_glm_moe_config("qwen2_moe"))
    assert hf.model.layers[0].mlp.gate.weight.abs().min() > 0
    assert hf.model.layers[0].mlp.shared_expert_gate.weight.abs().min() > 0


# -- tensor parallelism --------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "qwen2_moe", "glm",
    pytest.param("mixtral", marks=pytest.mark.full_grid),
    pytest.param("qwen3_moe", marks=pytest.mark.full_grid),
    pytest.param("glm4", marks=pytest.mark.full_grid),
])
def test_two_ranks_generate_like_hf(tmp_path: Path, name: str) -> None:
    """Experts' (and the shared expert's) intermediate features split over two ranks like
    the dense MLP's; GLM's fused gate_up cut as Llama's gate and up."""
    from vllm_lite import LLM, SamplingParams

    hf_model = save_hf_model(make_glm_moe_config(name), tmp_path)
    prompts = _prompts()[:3]
    refs = [hf_greedy(hf_model, p, 6) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tensor_parallel_size=2,
              block_size=4, kv_cache_space=0.01, swap_space=0.01, distributed_timeout=60)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.shutdown()


def test_olmoe_refuses_two_ranks(tmp_path: Path) -> None:
    from vllm_lite.models import OlmoeForCausalLM

    class _TwoRanks:
        rank, size = 0, 2

    with pytest.raises(ValueError, match="tensor parallelism"):
        OlmoeForCausalLM(make_glm_moe_config("olmoe"), tp=_TwoRanks())  # type: ignore[arg-type]


@pytest.mark.parametrize("name,dtype", [
    ("mixtral", "bfloat16"), ("glm4", "bfloat16"),
    pytest.param("qwen2_moe", "bfloat16", marks=pytest.mark.full_grid),
    pytest.param("qwen3_moe", "float16", marks=pytest.mark.full_grid),
    pytest.param("olmoe", "bfloat16", marks=pytest.mark.full_grid),
])
def test_half_precision_tracks_float32_hf(tmp_path: Path, name: str, dtype: str) -> None:
    """Weights, activations and cache in bf16 / fp16 (the MoE block's weighted sum in
    float32): logits within half-precision rounding of the float32 reference."""
    from .helpers import PagedCache, make_step

    hf_model = save_hf_model(make_glm_moe_config(name), tmp_path)
    torch_dtype = getattr(torch, dtype)
    model, config = load_model(tmp_path, dtype=dtype)
    mlp = model.model.layers[-1].mlp
    weight = mlp.down_proj.weight if name == "glm4" else mlp.experts.w13_weight
    assert weight.dtype == torch_dtype
    tokens = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(hf_model, tokens)
    cache = PagedCache(model, num_blocks=8, block_size=4, dtype=torch_dtype)
    tol = 0.05 * ref.abs().max().item()
    ids, pos, meta = make_step(cache, [(0, tokens[:12], 0)], is_prompt=True)
    assert (_run(model, ids, pos, meta).float() - ref[:12]).abs().max().item() < tol
    for step in range(2):
        ids, pos, meta = make_step(cache, [(0, tokens[: 13 + step], 12 + step)], is_prompt=False)
        logits = _run(model, ids, pos, meta).float()
        assert (logits[0] - ref[12 + step]).abs().max().item() < tol
