"""Mixture-of-experts GGUF files (llama.cpp's Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE layouts,
written here with the gguf package) converted and run by the engine: greedy outputs and
logits equal to HF transformers on the weights the file holds (dequantized for the
quantized types), the tokenizer carried over, bad files refused naming the key or tensor
before any tensor is read; its Q8_0 / Q4_1 / Q4_0 blocks kept by default (every expert's
too), and the other quantization options of a MoE GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a model hub

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("gguf")

from .gguf_writer import write_moe_gguf  # noqa: E402
from .helpers import BASE, assert_all_free, hf_greedy, hf_logits, make_hf_model  # noqa: E402
from vllm_lite.layers.attention import AttentionMetadata, attention_metadata  # noqa: E402
from vllm_lite.layers.moe import SplitExperts  # noqa: E402
from vllm_lite.layers.quantization import Int4Linear, Int8GroupLinear  # noqa: E402
from vllm_lite.models import load_model, resolve_model  # noqa: E402

#: The test tokenizer's vocabulary (tests/models/helpers.make_tokenizer): the models' too.
VOCAB = 287


def gguf_moe_config(name: str, **overrides: object):
    """Tiny configs whose projections and experts are whole 32-weight blocks (so every
    quantized type applies): 8 experts, 2 or 3 routed per token."""
    import transformers as tf

    base = {**BASE, "vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 0}
    if name == "mixtral":
        cfg = tf.MixtralConfig(**{**base, "intermediate_size": 32}, num_local_experts=8,
                               num_experts_per_tok=2)
    elif name == "qwen2_moe":
        # Layer 1 dense (mlp_only_layers): llama.cpp's names for it are the dense ones.
        cfg = tf.Qwen2MoeConfig(**{**base, "num_hidden_layers": 3}, num_experts=8,
                                num_experts_per_tok=3, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, mlp_only_layers=[1],
                                norm_topk_prob=False)
    elif name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**base, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True)
    elif name == "olmoe":
        cfg = tf.OlmoeConfig(**{**base, "intermediate_size": 32}, num_experts=8,
                             num_experts_per_tok=2, clip_qkv=2.0, norm_topk_prob=False)
    else:
        raise KeyError(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# Each architecture with another storage type; the full grid adds the rest.
CASES = [("mixtral", "Q8_0"), ("qwen2_moe", "Q4_1"), ("qwen3_moe", "F16"), ("olmoe", "F32")]
FULL = [pytest.param(n, q, marks=pytest.mark.full_grid) for n in ARCHITECTURES
        for q in ("F32", "F16", "Q8_0", "Q4_1", "Q4_0") if (n, q) not in CASES]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write(tmp_path: Path, name: str, qtype: str = "F32", seed: int = 0,
           extra: dict | None = None, **overrides: object):
    """(path, HF model holding the file's weights)."""
    hf_model = make_hf_model(gguf_moe_config(name, **overrides), seed)
    path = write_moe_gguf(hf_model, tmp_path / f"tiny-{name}-{qtype}.gguf", qtype, extra)
    return path, hf_model


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


@torch.no_grad()
def _prefill_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    n = len(ids)
    meta = AttentionMetadata(True, torch.full((n,), -1), torch.tensor([n], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32),
                             torch.zeros((1, 0), dtype=torch.int32), n, 16)
    with attention_metadata(meta):
        return model.compute_logits(model(ids, torch.arange(n))).float()


@pytest.mark.parametrize("name,qtype", CASES + FULL)
def test_moe_gguf_generates_like_hf(tmp_path: Path, cache: Path, name: str,
                                    qtype: str) -> None:
    """The engine on the GGUF file (its default quantization: Q8_0 / Q4_1 / Q4_0 blocks
    kept, every expert's included; F32 / F16 in the dtype) against HF on the same weights:
    every logit of a prefill of the converted (dequantized) folder, then LLM.generate's
    greedy tokens under preemption (a small KV cache)."""
    from vllm_lite import LLM, SamplingParams

    path, hf_model = _write(tmp_path, name, qtype)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, kv_cache_space=0.01,
              swap_space=0.01, num_gpu_blocks_override=14)
    mc = llm.llm_engine.config.model_config
    kept = qtype.startswith("Q")
    assert mc.quantization == ("gguf" if kept else None)
    assert mc.gguf_file == str(path.resolve())
    experts = [m for m in llm.llm_engine.model.modules() if isinstance(m, SplitExperts)]
    assert bool(experts) == kept
    for split in experts:  # each expert's projections are the file's blocks
        for e in range(split.num_experts):
            expert = split.expert(e)
            assert isinstance(expert.gate_up_proj, (Int4Linear, Int8GroupLinear))
            assert isinstance(expert.down_proj, (Int4Linear, Int8GroupLinear))
    config = mc.hf_config
    assert config.architectures == [ARCHITECTURES[name]]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "num_experts_per_tok", "vocab_size",
                "tie_word_embeddings"):
        assert getattr(config, key) == getattr(hf_model.config, key), key
    for key in ("num_experts", "num_local_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "clip_qkv",
                "mlp_only_layers", "qkv_bias", "head_dim"):
        if getattr(hf_model.config, key, None) is not None:
            assert getattr(config, key) == getattr(hf_model.config, key), key

    ids = torch.tensor(_prompts(1)[3])
    ours = _prefill_logits(load_model(path)[0], ids)  # the converted folder, no cache
    ref = hf_logits(hf_model, ids)
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)

    params = SamplingParams(temperature=0.0, max_tokens=10)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 10)
                                                      for p in _prompts()]
    assert llm.llm_engine.scheduler.num_preemptions["recompute"] > 0
    assert_all_free(llm)


def test_converted_folder_and_tokenizer(tmp_path: Path, cache: Path) -> None:
    """The cache folder: config.json in HF form, per-expert float32 weights in HF names
    (Mixtral's q / k rows un-permuted), the GGUF's tokenizer; a second load converts
    nothing."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from vllm_lite.models import gguf as gguf_mod

    path, hf_model = _write(tmp_path, "mixtral", "F32")
    folder = resolve_model(path)
    assert folder.parent == cache
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["MixtralForCausalLM"] and raw["num_local_experts"] == 8
    state = load_file(folder / "model.safetensors")
    want = hf_model.state_dict()
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"],
                       want["model.layers.1.self_attn.q_proj.weight"])
    gate_up = want["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(state["model.layers.1.block_sparse_moe.experts.5.w3.weight"],
                       gate_up[5, 32:])
    assert torch.equal(state["model.layers.0.block_sparse_moe.experts.7.w2.weight"],
                       want["model.layers.0.mlp.experts.down_proj"][7])
    assert all(t.dtype == torch.float32 for t in state.values())

    ours = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    source = AutoTokenizer.from_pretrained(tmp_path / "tiny-mixtral-F32_tokenizer",
                                           local_files_only=True)
    text = "hello world, the cat sat on the mat. café naïve<eos>"
    assert ours(text)["input_ids"] == source(text)["input_ids"]
    assert ours.eos_token == "<eos>"

    calls = []
    real = gguf_mod._convert
    gguf_mod._convert = lambda *a: calls.append(a) or real(*a)
    try:
        assert resolve_model(path) == folder and not calls
    finally:
        gguf_mod._convert = real


def test_expert_weights_norm_and_linear_rope(tmp_path: Path, cache: Path) -> None:
    """Metadata that changes the model: Qwen2-MoE's top-k weights renormalised
    (expert_weights_norm; llama.cpp's default for qwen2moe is not to) and linear rope
    scaling, both carried into the config and matching HF built with them."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    path, hf_model = _write(tmp_path, "qwen2_moe", extra={
        "qwen2moe.expert_weights_norm": True, "qwen2moe.rope.scaling.type": "linear",
        "qwen2moe.rope.scaling.factor": 2.0}, norm_topk_prob=True, rope_parameters=rope)
    model, config = load_model(path)
    assert config.norm_topk_prob is True
    assert config.rope_parameters["rope_type"] == "linear"
    ids = torch.tensor(_prompts(2)[3])
    torch.testing.assert_close(_prefill_logits(model, ids), hf_logits(hf_model, ids),
                               atol=2e-5, rtol=1e-4)


BAD_METADATA = {
    "top_k_above_experts": ({"olmoe.expert_used_count": 9}, "olmoe.expert_used_count"),
    "too_many_experts": ({"olmoe.expert_count": 100000}, "olmoe.expert_count"),
    "sigmoid_gating": ({"olmoe.expert_gating_func": 2}, "olmoe.expert_gating_func"),
    "scaled_weights": ({"olmoe.expert_weights_scale": 2.5}, "olmoe.expert_weights_scale"),
    "yarn": ({"olmoe.rope.scaling.type": "yarn"}, "olmoe.rope.scaling.type"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_moe_metadata_is_named_before_tensors_are_read(
        tmp_path: Path, cache: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite.models import gguf_moe

    edit, key = BAD_METADATA[case]
    path, _ = _write(tmp_path, "olmoe")
    import gguf

    # Rewrite the file with the metadata changed (the writer refuses duplicate keys).
    reader = gguf.GGUFReader(str(path))
    out = tmp_path / f"bad-{case}.gguf"
    writer = gguf.GGUFWriter(str(out), arch="olmoe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *edit):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for k, v in edit.items():
        if isinstance(v, str):
            writer.add_string(k, v)
        elif isinstance(v, float):
            writer.add_float32(k, v)
        else:
            writer.add_uint32(k, v)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors were read")

    monkeypatch.setattr(gguf_moe, "hf_weights", no_tensors)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        resolve_model(out)
    assert not cache.exists() or not any(cache.iterdir())


def _rewrite(src: Path, out: Path, drop: str = "", add: str = "") -> Path:
    """``src`` without the tensor ``drop`` / with a stray tensor ``add``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    if add:
        writer.add_tensor(add, np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_missing_or_stray_tensors_are_named(tmp_path: Path, cache: Path) -> None:
    path, _ = _write(tmp_path, "qwen2_moe")
    for drop in ("blk.2.ffn_down_exps.weight", "blk.0.ffn_up_shexp.weight",
                 "blk.0.ffn_gate_inp_shexp.weight"):
        bad = _rewrite(path, tmp_path / "missing.gguf", drop=drop)
        with pytest.raises(ValueError, match=f"tensor {drop.replace('.', '[.]')}"):
            resolve_model(bad)
        bad.unlink()
    # A tensor the conversion has no place for is refused, not dropped.
    bad = _rewrite(path, tmp_path / "stray.gguf", add="blk.0.attn_sinks.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight has no place"):
        resolve_model(bad)
    assert not any(p.name.startswith("stray") for p in cache.iterdir())


# -- quantization options -------------------------------------------------------------------
def test_quantization_options_of_a_moe_gguf(tmp_path: Path, cache: Path) -> None:
    """quantization="gguf" (blocks kept) on a file with float projections is refused at
    load naming the tensor; int8 requantizes the dequantized weights, experts included;
    "none" loads the blocks dequantized."""
    from vllm_lite import LLM
    from vllm_lite.config import EngineArgs

    path, _ = _write(tmp_path, "qwen3_moe", "F16")
    with pytest.raises(ValueError, match=r"quantization='gguf' keeps Q4_0, Q4_1 and Q8_0 "
                                         r"projections; blk\.0\.attn_q\.weight is F16"):
        LLM(str(path), dtype="float32", device="cpu", quantization="gguf",
            kv_cache_space=0.01, swap_space=0.01)
    path, _ = _write(tmp_path, "qwen3_moe", "Q8_0")
    args = dict(model=str(path), device="cpu")
    assert EngineArgs(**args).create_engine_config().model_config.quantization == "gguf"
    assert EngineArgs(**args, quantization="int8").create_engine_config() \
        .model_config.quantization == "int8"
    assert EngineArgs(**args, quantization="none").create_engine_config() \
        .model_config.quantization is None


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_awq_moe_checkpoint_groups_checked_before_reading(tmp_path: Path,
                                                                method: str) -> None:
    """A GPTQ / AWQ checkpoint of a MoE model whose group size does not divide the experts'
    inputs: refused before any weight is read (the weights file here is garbage), naming
    the field. (Checkpoints that fit run: tests/models/test_moe_quantization.py.)"""
    from vllm_lite.config import EngineArgs

    gguf_moe_config("mixtral").save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["MixtralForCausalLM"]
    raw["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "desc_act": False, "sym": True} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": 128,
                                   "zero_point": True, "version": "gemm"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"the {method} checkpoint's quantization_config\."
                                         rf"group_size \(128\) must divide the model's "
                                         rf"hidden_size"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def test_kept_expert_blocks_split_over_two_ranks(tmp_path: Path, cache: Path) -> None:
    """A MoE GGUF's kept blocks over two tensor-parallel ranks: each expert's (and the
    shared expert's) rows of gate / up and whole blocks of down's inputs per rank; the same
    greedy tokens as HF on the file's weights."""
    from vllm_lite import LLM, SamplingParams

    # Each rank's experts get 32 intermediate features: whole 32-weight blocks.
    path, hf_model = _write(tmp_path, "qwen2_moe", "Q4_1", moe_intermediate_size=64)
    llm = LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2, block_size=4,
              kv_cache_space=0.01, swap_space=0.01, distributed_timeout=60)
    try:
        assert llm.llm_engine.config.model_config.quantization == "gguf"
        prompts = _prompts()[:2]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 8)
                                                          for p in prompts]
    finally:
        llm.shutdown()
