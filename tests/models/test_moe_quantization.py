"""Quantized experts of the mixture-of-experts models (Mixtral, Qwen2-MoE with its shared
expert, Qwen3-MoE, OLMoE): quantization="int8" / "int4" and GPTQ / AWQ checkpoints written
here in HF's per-expert layout. Each is checked against HF transformers on the same
dequantized weights (greedy tokens equal), the quantized MoE block against a float64
reference, the checkpoints' 4-bit weights bit for bit, two tensor-parallel ranks against
one and HF, and settings that cannot run refused naming the field before any weight is
read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import make_llm  # noqa: E402
from models.helpers import hf_greedy, make_glm_moe_config, make_hf_model  # noqa: E402
from models.test_gptq_awq import quantize  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402
from vllm_lite.layers.moe import FusedMoE, SplitExperts, select_experts  # noqa: E402
from vllm_lite.layers.quantization import (  # noqa: E402
    Int4Linear,
    Int8Linear,
    dequantize_int8,
    quantize_model,
)
from vllm_lite.models.gguf_quant import Int4Weight  # noqa: E402

MOE_NAMES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def moe_config(name: str, eos: bool = True, **overrides: object):
    """The tiny MoE config of models/helpers.py with every GEMM input a multiple of 32 (so
    int4 / GPTQ / AWQ groups of 32 fit): hidden 64, experts' intermediate 32 or more."""
    config = make_glm_moe_config(name)
    if name == "mixtral":
        config.intermediate_size = 64
    elif name == "qwen2_moe":
        config.moe_intermediate_size, config.shared_expert_intermediate_size = 32, 64
    elif name == "qwen3_moe":
        config.moe_intermediate_size = 32
    config.architectures = [{"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM",
                             "olmoe": "OlmoeForCausalLM"}[name]]
    if not eos:  # HF generate runs the full length, like ignore_eos
        config.eos_token_id = None
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _prompts(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 160, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """A quantized layer's weight [N, K] in float32, columns in the input's order."""
    if isinstance(layer, Int8Linear):
        return dequantize_int8(layer.qweight_rows(), layer.scales)
    assert isinstance(layer, Int4Linear)
    return Int4Weight(layer.qweight_rows(), layer.scales, layer.zeros, layer.group_size,
                      layer.perm).dequantize()


def put_dequantized(hf_model: torch.nn.Module, model: torch.nn.Module) -> int:
    """Copies every quantized layer of our ``model`` (dequantized) into the HF model's
    matching weights; returns how many layers."""
    params = dict(hf_model.named_parameters())
    n = 0
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, (Int8Linear, Int4Linear)):
                continue
            n += 1
            w = dequantized(layer)
            pre, _, proj = name.rpartition(".")
            if proj == "qkv_proj":
                parts = [params[f"{pre}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
                for p, chunk in zip(parts, w.split([p.shape[0] for p in parts]), strict=True):
                    p.copy_(chunk)
            elif ".experts." in name:  # HF's experts.gate_up_proj [E, 2I, H] / down_proj
                experts, _, e = pre.rpartition(".")
                params[f"{experts}.{proj}"][int(e)].copy_(w)
            elif proj == "gate_up_proj":
                gate, up = w.chunk(2)
                params[f"{pre}.gate_proj.weight"].copy_(gate)
                params[f"{pre}.up_proj.weight"].copy_(up)
            else:
                params[f"{name}.weight"].copy_(w)
    return n


def _expected_layers(config, name: str) -> int:
    """Quantized layers of the model: attention 2, dense MLP 2, per expert 2, shared 2."""
    from vllm_lite.models.registry import get_model_class

    cls = get_model_class(config.architectures)
    experts = getattr(config, cls.num_experts_field)
    total = 0
    for i in range(config.num_hidden_layers):
        sparse = cls.is_sparse(config, i)
        total += 2 + (2 * experts + 2 * cls.has_shared_expert if sparse else 2)
    return total


# -- the engine against HF on the dequantized weights ----------------------------------------
CASES = [("mixtral", "int8"), ("qwen2_moe", "int4"), ("qwen3_moe", "int8"), ("olmoe", "int4"),
         pytest.param("mixtral", "int4", marks=pytest.mark.full_grid),
         pytest.param("qwen2_moe", "int8", marks=pytest.mark.full_grid),
         pytest.param("qwen3_moe", "int4", marks=pytest.mark.full_grid),
         pytest.param("olmoe", "int8", marks=pytest.mark.full_grid)]


@pytest.mark.parametrize("name,method", CASES)
def test_quantized_experts_generate_like_hf(tmp_path: Path, name: str, method: str) -> None:
    """Every projection but the routers and the head quantized, each expert's own GEMMs
    included; greedy tokens equal HF's (float32) on the dequantized weights."""
    config = moe_config(name)
    hf_model = make_hf_model(config)
    hf_model.save_pretrained(tmp_path)
    llm = make_llm(tmp_path, quantization=method,
                   **({"quantization_group_size": 32} if method == "int4" else {}))
    model = llm.llm_engine.model
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert any(isinstance(m, SplitExperts) for m in model.modules())
    assert put_dequantized(hf_model, model) == _expected_layers(config, name)
    for m in model.modules():  # the routers stay in the model's dtype
        if type(m).__name__ == "Router":
            assert m.weight.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=10)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 10)
                                                      for p in _prompts()]


# -- the quantized block against float64 -----------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5, 40])
def test_split_experts_match_float64(method: str, dtype: torch.dtype, tokens: int) -> None:
    """The quantized experts block on fresh random inputs against the MoE block's math in
    float64 on the dequantized weights (routing taken from the same logits)."""
    torch.manual_seed(tokens + 7 * (method == "int4"))
    experts, top_k, hidden, inter = 8, 3, 64, 96
    moe = FusedMoE(hidden, experts, top_k, inter, renormalize=True)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(experts, 2 * inter, hidden) * 0.2)
        moe.w2_weight.copy_(torch.randn(experts, hidden, inter) * 0.2)
    holder = torch.nn.Module()
    holder.experts = moe
    quantize_model(holder, method, group_size=32)
    split = holder.experts
    assert isinstance(split, SplitExperts)
    x = torch.randn(tokens, hidden).to(dtype)
    logits = torch.randn(tokens, experts)
    with torch.no_grad():
        got = split(x, logits)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if tokens == 0:
        return
    w13 = torch.stack([dequantized(split.expert(e).gate_up_proj) for e in range(experts)])
    w2 = torch.stack([dequantized(split.expert(e).down_proj) for e in range(experts)])
    weights, ids = select_experts(logits, top_k, True)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    xd = x.double()
    for t in range(tokens):
        for s in range(top_k):
            e = int(ids[t, s])
            gate, up = (xd[t] @ w13[e].double().T).chunk(2)
            want[t] += float(weights[t, s]) * (w2[e].double() @ (torch.nn.functional.silu(gate)
                                                                 * up))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = float(want.abs().max())
    assert float((got.double() - want).abs().max()) <= tol * scale


def test_an_expert_no_token_chose_costs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call per chosen expert's projections, none for the others."""
    moe = FusedMoE(64, 8, 2, 32, renormalize=True)
    torch.nn.init.normal_(moe.w13_weight)
    torch.nn.init.normal_(moe.w2_weight)
    holder = torch.nn.Module()
    holder.experts = moe
    quantize_model(holder, "int8")
    split = holder.experts
    calls: list[int] = []
    for e in range(8):
        layer = split.expert(e).gate_up_proj
        original = layer.forward
        layer.forward = (lambda x, e=e, f=original: (calls.append(e), f(x))[1])
    logits = torch.full((3, 8), -10.0)
    logits[:, 2] = logits[:, 5] = 5.0  # every token routed to experts 2 and 5
    with torch.no_grad():
        split(torch.randn(3, 64), logits)
    assert calls == [2, 5]


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_dequantized_at_load_run_fused(monkeypatch: pytest.MonkeyPatch,
                                               dtype: torch.dtype, method: str) -> None:
    """Where the format has no kernel (int4 off the CPU, int8 where torch has no int8 GEMM
    either; here the checks patched so the CPU is such a device), each expert projection
    dequantizes at load, keeping no quantized copy beside the dense weight, and the layer
    becomes one FusedMoE again on exactly those weights, answering as the per-expert layers
    do; with the kernel (the CPU) the experts stay quantized."""
    from vllm_lite.layers import quantization

    torch.manual_seed(5)
    experts, top_k, hidden, inter = 8, 2, 64, 32
    base = FusedMoE(hidden, experts, top_k, inter, renormalize=True).to(dtype)
    with torch.no_grad():
        base.w13_weight.copy_(torch.randn(experts, 2 * inter, hidden) * 0.2)
        base.w2_weight.copy_(torch.randn(experts, hidden, inter) * 0.2)

    def quantized(fuse: bool) -> torch.nn.Module:
        holder = torch.nn.Module()
        holder.experts = FusedMoE(hidden, experts, top_k, inter, renormalize=True).to(dtype)
        holder.experts.load_state_dict(base.state_dict())
        with monkeypatch.context() as m:
            m.setattr(quantization, "_int4_kernel_on", lambda device: False)
            m.setattr(quantization, "_int8_kernel_on", lambda device: False)
            m.setattr(quantization, "_int8_mm_works", lambda device, dtype: False)
            if not fuse:
                m.setattr(quantization, "_fuse_dequantized_experts", lambda model: None)
            quantize_model(holder, method, group_size=32)
        return holder.experts

    fused, split = quantized(fuse=True), quantized(fuse=False)
    assert isinstance(fused, FusedMoE) and isinstance(split, SplitExperts)
    for e in range(experts):
        for proj in (split.expert(e).gate_up_proj, split.expert(e).down_proj):
            assert proj._dequantized is not None and proj._dequantized.dtype == dtype
            assert not dict(proj.named_buffers()), "a quantized copy kept beside the dense one"
        assert torch.equal(fused.w13_weight[e], split.expert(e).gate_up_proj._dequantized)
        assert torch.equal(fused.w2_weight[e], split.expert(e).down_proj._dequantized)
    x, logits = torch.randn(40, hidden).to(dtype), torch.randn(40, experts)
    with torch.no_grad():
        got, want = fused(x, logits).double(), split(x, logits).double()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())

    holder = torch.nn.Module()
    holder.experts = FusedMoE(hidden, experts, top_k, inter, renormalize=True).to(dtype)
    quantize_model(holder, method, group_size=32)
    assert isinstance(holder.experts, SplitExperts)  # the CPU keeps its quantized experts
    assert holder.experts.expert(0).down_proj._dequantized is None


# -- GPTQ / AWQ checkpoints in HF's per-expert layout ----------------------------------------
def expert_names(name: str, layer: int, e: int) -> tuple[str, str, str]:
    """HF checkpoint names of an expert's gate, up and down projections."""
    if name == "mixtral":
        return tuple(f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                     for w in ("w1", "w3", "w2"))  # type: ignore[return-value]
    return tuple(f"model.layers.{layer}.mlp.experts.{e}.{p}"
                 for p in ("gate_proj", "up_proj", "down_proj"))  # type: ignore[return-value]


def make_moe_checkpoint(folder: Path, name: str, method: str, group: int,
                        act_order: bool = False, **overrides: object) -> torch.nn.Module:
    """A tiny random MoE model saved as a ``method`` checkpoint in HF's layout (every
    attention, dense, shared-expert and per-expert projection quantized; routers, norms,
    embeddings and head float); returns the HF model holding the dequantized weights."""
    from safetensors.torch import save_file

    config = moe_config(name, eos=False, **overrides)
    model = make_hf_model(config, seed=group + act_order)
    gen = torch.Generator().manual_seed(7)
    state = {k: t.detach().clone().contiguous() for k, t in model.state_dict().items()}
    params = dict(model.named_parameters())
    deq: dict[str, tuple[torch.Tensor, int | None]] = {}  # HF param -> (weight, expert)

    def put(prefix: str, w: torch.Tensor, perm: torch.Tensor | None, target: str,
            expert: int | None = None) -> None:
        tensors, d = quantize(w, method, group, False, perm)
        for part, t in tensors.items():
            state[f"{prefix}.{part}"] = t
        deq[f"{prefix}"] = (d, expert)
        deq_targets[f"{prefix}"] = target

    def perm_for(k: int) -> torch.Tensor | None:
        return torch.randperm(k, generator=gen) if act_order else None

    deq_targets: dict[str, str] = {}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        attn_perm = perm_for(config.hidden_size)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = state.pop(f"{pre}self_attn.{p}.weight")
            put(f"{pre}self_attn.{p}", w, attn_perm if p != "o_proj" else perm_for(w.shape[1]),
                f"{pre}self_attn.{p}.weight")
        mlps = [m for m in ("mlp", "mlp.shared_expert") if f"{pre}{m}.gate_proj.weight" in state]
        for m in mlps:
            in_perm = perm_for(config.hidden_size)
            for p in ("gate_proj", "up_proj", "down_proj"):
                w = state.pop(f"{pre}{m}.{p}.weight")
                put(f"{pre}{m}.{p}", w, in_perm if p != "down_proj" else perm_for(w.shape[1]),
                    f"{pre}{m}.{p}.weight")
        if f"{pre}mlp.experts.gate_up_proj" in state:
            gate_up = state.pop(f"{pre}mlp.experts.gate_up_proj")
            down = state.pop(f"{pre}mlp.experts.down_proj")
            for e in range(gate_up.shape[0]):
                in_perm = perm_for(config.hidden_size)
                g, u, d = expert_names(name, i, e)
                gate, up = gate_up[e].chunk(2)
                put(g, gate, in_perm, f"{pre}mlp.experts.gate_up_proj", e)
                put(u, up, in_perm, f"{pre}mlp.experts.gate_up_proj", e)
                put(d, down[e], perm_for(down.shape[2]), f"{pre}mlp.experts.down_proj", e)
            if name == "mixtral":
                state[f"{pre}block_sparse_moe.gate.weight"] = state.pop(f"{pre}mlp.gate.weight")
    state = {k: v for k, v in state.items() if "rotary" not in k}
    config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": False} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"})
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state, str(folder / "model.safetensors"))
    with torch.no_grad():  # the HF model on the dequantized weights
        for prefix, (d, expert) in deq.items():
            target = params[deq_targets[prefix]]
            if expert is None:
                target.copy_(d)
            elif prefix.endswith(("w2", "down_proj")):
                target[expert].copy_(d)
            else:  # gate rows first, then up
                half = target.shape[1] // 2
                second = prefix.endswith(("w3", "up_proj"))
                target[expert, half * second:half * (second + 1)].copy_(d)
    return model


GPTQ_AWQ = [("mixtral", "gptq", 32, False), ("qwen2_moe", "awq", 32, False),
            ("olmoe", "gptq", 32, True),
            pytest.param("qwen3_moe", "awq", 32, False, marks=pytest.mark.full_grid),
            pytest.param("qwen2_moe", "gptq", 32, True, marks=pytest.mark.full_grid),
            pytest.param("mixtral", "awq", 64, False, marks=pytest.mark.full_grid)]


@pytest.mark.parametrize("name,method,group,act_order", GPTQ_AWQ)
def test_gptq_awq_moe_checkpoints_run_their_4bit_experts(
        tmp_path: Path, name: str, method: str, group: int, act_order: bool) -> None:
    """Each expert's 4-bit weights loaded exactly (no rounding: the dequantized weights are
    the quantizer's, bit for bit) and run as int4 GEMMs; greedy tokens equal HF's on the
    dequantized weights (float32)."""
    hf_model = make_moe_checkpoint(tmp_path, name, method, group, act_order)
    llm = make_llm(tmp_path)  # quantization None: the checkpoint's own method
    assert llm.llm_engine.config.model_config.quantization == method
    model = llm.llm_engine.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == _expected_layers(hf_model.config, name)
    hf_params = dict(hf_model.named_parameters())
    for n, layer in layers.items():
        assert layer.group_size == group
        if ".experts." in n:
            pre, _, proj = n.rpartition(".")
            experts, _, e = pre.rpartition(".")
            want = hf_params[f"{experts}.{proj}"][int(e)]
            assert torch.equal(dequantized(layer), want), n
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 10)
                                                      for p in _prompts()]


def test_a_float_expert_in_a_gptq_checkpoint_is_named(tmp_path: Path) -> None:
    """An expert left unquantized: a ValueError naming it (not a half-quantized model)."""
    from safetensors.torch import load_file, save_file

    make_moe_checkpoint(tmp_path, "qwen3_moe", "awq", 32)
    state = load_file(str(tmp_path / "model.safetensors"))
    for part in ("qweight", "qzeros", "scales"):
        del state[f"model.layers.1.mlp.experts.5.up_proj.{part}"]
    state["model.layers.1.mlp.experts.5.up_proj.weight"] = torch.zeros(32, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj is not "
                                         r"awq-quantized"):
        make_llm(tmp_path)


# -- refused before any weight is read -------------------------------------------------------
def _config_only(folder: Path, name: str, **qc: object) -> None:
    """A model folder whose weights file is garbage: anything that reads it fails."""
    moe_config(name).save_pretrained(folder)
    if qc:
        raw = json.loads((folder / "config.json").read_text())
        raw["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")


def test_int4_groups_that_do_not_divide_an_expert_are_refused(tmp_path: Path) -> None:
    from vllm_lite.config import EngineArgs

    _config_only(tmp_path, "qwen2_moe")
    args = dict(model=str(tmp_path), device="cpu", quantization="int4")
    with pytest.raises(ValueError, match=r"quantization_group_size \(128\) must divide the "
                                         r"model's hidden_size \(64\)"):
        EngineArgs(**args).create_engine_config()  # the default group, 128
    with pytest.raises(ValueError, match=r"quantization_group_size \(64\) must divide the "
                                         r"model's moe_intermediate_size \(32\)"):
        EngineArgs(**args, quantization_group_size=64).create_engine_config()
    with pytest.raises(ValueError, match=r"quantization_group_size \(32\) must divide the "
                                         r"model's moe_intermediate_size \(32 / "
                                         r"tensor_parallel_size 2 = 16 per rank\)"):
        EngineArgs(**args, quantization_group_size=32,
                   tensor_parallel_size=2).create_engine_config()
    assert EngineArgs(**args, quantization_group_size=32).create_engine_config() \
        .model_config.quantization == "int4"


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoint_group_that_does_not_divide_an_expert_is_refused(tmp_path: Path,
                                                                     method: str) -> None:
    from vllm_lite.config import EngineArgs

    qc = ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}
          if method == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
           "version": "gemm"})
    _config_only(tmp_path, "qwen3_moe", **qc)
    with pytest.raises(ValueError, match=rf"the {method} checkpoint's quantization_config\."
                                         rf"group_size \(64\) must divide the model's "
                                         rf"moe_intermediate_size \(32\)"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


# -- tensor parallelism ----------------------------------------------------------------------
def _two_rank_llm(folder: Path, **kw: object):
    return make_llm(folder, tensor_parallel_size=2, distributed_timeout=60, **kw)


def test_awq_experts_split_over_two_ranks(tmp_path: Path) -> None:
    """Each expert's (and the shared expert's) 4-bit weights cut like the dense MLP's:
    rows of gate / up, whole groups of down's inputs; the same tokens as one rank and as
    HF on the dequantized weights (float32)."""
    # Each rank's experts get 32 intermediate features, the shared expert's 64: whole groups.
    hf_model = make_moe_checkpoint(tmp_path, "qwen2_moe", "awq", 32, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=128)
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = make_llm(tmp_path)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = _two_rank_llm(tmp_path)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == want == [hf_greedy(hf_model, p, 8) for p in prompts]


@pytest.mark.full_grid
def test_int8_experts_split_over_two_ranks(tmp_path: Path) -> None:
    """int8 experts over two ranks: gate / up rows quantized per row, so rank 0's equal the
    unsplit engine's first half of each expert's intermediate features; tokens agree with
    one rank on most positions (down's rows quantize each rank's inputs on their own)."""
    make_hf_model(moe_config("mixtral")).save_pretrained(tmp_path)
    one = make_llm(tmp_path, quantization="int8")
    two = _two_rank_llm(tmp_path, quantization="int8")
    try:
        q1 = one.llm_engine.model.model.layers[0].mlp.experts.expert(3).gate_up_proj
        q2 = two.llm_engine.model.model.layers[0].mlp.experts.expert(3).gate_up_proj
        rows1, inter = q1.qweight_rows(), 64
        expect = torch.cat([rows1[:inter // 2], rows1[inter:inter + inter // 2]])
        assert torch.equal(q2.qweight_rows(), expect)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        a = [o.outputs[0].token_ids for o in one.generate(_prompts(), params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in two.generate(_prompts(), params, use_tqdm=False)]
    finally:
        two.shutdown()
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert same >= 0.75 * sum(len(r) for r in a), (a, b)
