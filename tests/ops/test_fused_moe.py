"""torch.ops.vllm_lite.fused_moe against a float64 reference: every CPU build this machine
runs (packed_linear's kernels on packed weights where the build has them, ATen elsewhere),
plain and packed weights, float32 / bfloat16 / float16, expert counts 4-64, top-k 1-8, token
counts 1-4096, experts no token chose (their weights NaN: never read), every buffer the op
allocates NaN-filled (torch's deterministic fill of uninitialized memory), H and I that end
mid-panel; bad arguments raise naming the argument and change nothing; opcheck. CUDA runs the
same cases where a GPU is visible (tests/cuda_emulation runs the CUDA kernels without one)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_lite import ops

from .conftest import cuda_mark, nan_filled_buffers
from .reference import bits

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass(frozen=True)
class Case:
    experts: int
    top_k: int
    tokens: int
    hidden: int = 64
    inter: int = 40
    tied: bool = False  # router logits with exact ties (tied_logits)

    @property
    def id(self) -> str:
        return (f"E{self.experts}-k{self.top_k}-T{self.tokens}-H{self.hidden}-I{self.inter}"
                + ("-tied" if self.tied else ""))


# Experts 4-64, top-k 1-8, tokens 1-4096; H and I ending mid-panel (48 columns, gated 24)
# and spanning several panels; (32, 2, 1), (64, 8, 3): most experts idle; (8, 2, 60): experts
# on both sides of the AVX2 few-rows GEMM's 16 rows, with H and I not multiples of its 8 lanes;
# tied: every top-k decided by exact ties (to the lower expert id).
CASES = [Case(4, 1, 1), Case(8, 2, 7, 96, 24), Case(32, 2, 1), Case(64, 8, 3),
         Case(16, 4, 130, 50, 70), Case(64, 8, 33, 32, 16), Case(8, 2, 60, 50, 70),
         Case(8, 3, 9, 32, 24, tied=True)]
FULL_CASES = [Case(4, 4, 4096, 32, 24), Case(64, 1, 4096, 32, 24), Case(64, 8, 1000, 32, 24),
              Case(16, 2, 2048, 1024, 176), Case(8, 8, 257, 130, 200), Case(64, 8, 1)]
GRID = ([pytest.param(c, id=c.id) for c in CASES]
        + [pytest.param(c, id=c.id, marks=pytest.mark.full_grid) for c in FULL_CASES])


def separated_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits whose order is unambiguous in every dtype (distinct by >= 0.05, within
    bfloat16's resolution up to 64 experts): float32 and float64 pick the same top-k."""
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    return ranks.float() * 0.05 + 0.02 * torch.rand(tokens, experts, generator=gen)


def tied_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits in pairs of exact ties (each of experts / 2 levels, 0.5 apart, given to
    two experts at random), exact in every dtype: an odd top_k splits a tie, which the op
    breaks to the lower expert id."""
    levels = torch.arange(experts) // 2 * 0.5
    return torch.stack([levels[torch.randperm(experts, generator=gen)] for _ in range(tokens)])


def make_case(c: Case, dtype: torch.dtype, seed: int):
    """(hidden, logits, w13, w2) in dtype; the experts no token chose have NaN weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(c.tokens, c.hidden, generator=gen).to(dtype)
    w13 = (torch.randn(c.experts, 2 * c.inter, c.hidden, generator=gen) / c.hidden**0.5).to(dtype)
    w2 = (torch.randn(c.experts, c.hidden, c.inter, generator=gen) / c.inter**0.5).to(dtype)
    logits = (tied_logits if c.tied else separated_logits)(c.tokens, c.experts, gen).to(dtype)
    idle = torch.ones(c.experts, dtype=torch.bool)
    idle[top_k_lowest_id(logits.float(), c.top_k).unique()] = False
    w13[idle] = float("nan")
    w2[idle] = float("nan")
    return x, logits, w13, w2, idle


def top_k_lowest_id(values: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids of each row's top_k largest values, ties to the lower id (the op's rule;
    torch.topk leaves the order of ties unspecified)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :top_k]


def reference(x, logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    """float64 on the inputs' values: softmax, top-k (ties to the lower expert id), SwiGLU
    experts, weighted sum."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    probs = torch.softmax(logits.double(), dim=-1)
    ids = top_k_lowest_id(probs, top_k)
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        proj = x[tok] @ w13[e].t()
        act = torch.nn.functional.silu(proj[:, :inter]) * proj[:, inter:]
        out.index_add_(0, tok, weights[tok, slot].unsqueeze(1) * (act @ w2[e].t()))
    return out


def non_finite_case(c: Case, dtype: torch.dtype, seed: int, renormalize: bool):
    """make_case's inputs with tokens 0-2's router logits non-finite (one NaN; one +inf;
    all -inf): each makes its token's softmax NaN throughout, so the token still takes
    top_k distinct experts in range and its output row is NaN. Returns (x, logits, w13, w2,
    the float64 reference of tokens 3 on, which nothing of tokens 0-2 may touch)."""
    assert c.tokens > 3
    x, logits, w13, w2, _ = make_case(c, dtype, seed)
    logits[0, c.experts // 2] = float("nan")
    logits[1, 1] = float("inf")
    logits[2] = float("-inf")
    return x, logits, w13, w2, reference(x[3:], logits[3:], w13, w2, c.top_k, renormalize)


def check_non_finite(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isnan(out[:3]).all(), out[:3]
    check_close(out[3:], ref, dtype)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: accumulation order only; bfloat16 / float16: the op rounds the gate and up
    projections, the activation and each expert's output to the dtype (as the unfused
    layers do), so a few of its steps off, relative to the output's scale."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    scale = float(ref.abs().max()) + 1e-6
    rel = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rel, atol=rel * scale)


def run_case(c: Case, dtype: torch.dtype, renormalize: bool, device: str, packed: bool,
             seed: int) -> None:
    x, logits, w13, w2, idle = make_case(c, dtype, seed)
    ref = reference(x, logits, w13, w2, c.top_k, renormalize)
    if packed:
        w13, w2 = ops.pack_moe_weights(w13, w2)
    args = [t.to(device) for t in (x, logits, w13, w2)]
    with nan_filled_buffers():
        out = ops.fused_moe(*args, c.top_k, renormalize)
    check_close(out.cpu(), ref, dtype)
    if c.experts > c.top_k * c.tokens:
        assert idle.any()  # the case covers idle experts


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("c", GRID)
def test_matches_float64(isa: str, c: Case, dtype: torch.dtype, renormalize: bool) -> None:
    run_case(c, dtype, renormalize, "cpu", packed=False, seed=c.tokens * 7 + c.experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("c", GRID)
def test_packed_matches_float64(isa: str, c: Case, dtype: torch.dtype) -> None:
    """Weights packed by pack_moe_weights: packed_linear's kernels where the build has them
    for the dtype, packed_gated_linear's / packed_linear's fallbacks elsewhere."""
    run_case(c, dtype, True, "cpu", packed=True, seed=c.tokens * 5 + c.experts)


@cuda_mark
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("c", GRID)
def test_cuda_matches_float64(c: Case, dtype: torch.dtype) -> None:
    run_case(c, dtype, c.top_k % 2 == 0, "cuda", packed=False, seed=c.tokens * 3 + c.experts)


def test_threads_agree() -> None:
    """One thread and all of them give the same bits (each output is one thread's sum in
    slot order; the GEMMs' split over threads does not change an element's sum)."""
    x, logits, w13, w2, _ = make_case(Case(16, 2, 300, 96, 72), torch.float32, seed=11)
    many = ops.fused_moe(x, logits, w13, w2, 2, True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = ops.fused_moe(x, logits, w13, w2, 2, True)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_non_finite_logits_poison_only_their_tokens(device: str, dtype: torch.dtype) -> None:
    c = Case(64, 8, 20, 32, 24)
    x, logits, w13, w2, ref = non_finite_case(c, dtype, seed=9, renormalize=True)
    out = ops.fused_moe(*(t.to(device) for t in (x, logits, w13, w2)), c.top_k, True)
    check_non_finite(out.cpu(), ref, dtype)


def test_empty_and_layer_form() -> None:
    """No tokens: an empty [0, H]. The layer's fused_moe is this op."""
    from vllm_lite.layers.moe import fused_moe

    x, logits, w13, w2, _ = make_case(Case(8, 2, 5), torch.float32, seed=2)
    assert ops.fused_moe(x[:0], logits[:0], w13, w2, 2, False).shape == (0, 64)
    assert torch.equal(fused_moe(x, logits, w13, w2, 2, False),
                       ops.fused_moe(x, logits, w13, w2, 2, False))


def test_torch_form_matches_float64() -> None:
    """layers.moe.fused_moe_torch (the benchmarks' peer) states the same contract."""
    from vllm_lite.layers.moe import fused_moe_torch

    c = Case(16, 4, 50, 48, 40)
    x, logits, w13, w2, _ = make_case(c, torch.float32, seed=4)
    ref = reference(x, logits, w13, w2, c.top_k, False)
    check_close(fused_moe_torch(x, logits, w13, w2, c.top_k, False), ref, torch.float32)


# ---- bad arguments: RuntimeError naming the argument; nothing changes -------------------

def _valid(device: str = "cpu"):
    x, logits, w13, w2, _ = make_case(Case(8, 2, 5, 32, 16), torch.float32, seed=1)
    return [t.to(device) for t in (x, logits, w13, w2)]


BAD = {
    # name: (change(x, logits, w13, w2, top_k) -> args, message pattern)
    "hidden_dtype": (lambda x, lg, a, b, k: (x.double(), lg, a, b, k), "hidden must be float32"),
    "hidden_rank": (lambda x, lg, a, b, k: (x[None], lg, a, b, k), "hidden must be 2-D"),
    "hidden_strided": (lambda x, lg, a, b, k: (x.t().contiguous().t(), lg, a, b, k),
                       "hidden must be contiguous"),
    "logits_rows": (lambda x, lg, a, b, k: (x, lg[:3], a, b, k), "router_logits has 3 rows"),
    "logits_dtype": (lambda x, lg, a, b, k: (x, lg.long(), a, b, k), "router_logits must be"),
    "logits_strided": (lambda x, lg, a, b, k: (x, lg.t().contiguous().t(), a, b, k),
                       "router_logits must be contiguous"),
    "w13_dtype": (lambda x, lg, a, b, k: (x, lg, a.bfloat16(), b, k), "w13 is BFloat16"),
    "w2_dtype": (lambda x, lg, a, b, k: (x, lg, a, b.half(), k), "w2 is Half"),
    "w13_shape": (lambda x, lg, a, b, k: (x, lg, a[:, :-2].contiguous(), b, k),
                  "w13 must be \\[E, 2I, H\\]"),
    "w2_shape": (lambda x, lg, a, b, k: (x, lg, a, b[:, :-1].contiguous(), k),
                 "w2 must be \\[E, H, I\\]"),
    "w13_experts": (lambda x, lg, a, b, k: (x, lg, a[:4], b, k), "w13 must hold E = 8"),
    "w2_experts": (lambda x, lg, a, b, k: (x, lg, a, b[:7], k), "w2 must hold E = 8"),
    "w13_rank": (lambda x, lg, a, b, k: (x, lg, a.reshape(8, -1), b, k), "w13 must be 3-D"),
    "w13_strided": (lambda x, lg, a, b, k: (x, lg, a.transpose(1, 2).contiguous().transpose(1, 2),
                                            b, k), "w13 must be contiguous"),
    "top_k_zero": (lambda x, lg, a, b, k: (x, lg, a, b, 0), "top_k must be in \\[1, "),
    "top_k_above_experts": (lambda x, lg, a, b, k: (x, lg, a, b, 9), "top_k \\(9\\) exceeds"),
    "top_k_above_max": (lambda x, lg, a, b, k: (x, lg.repeat(1, 8), a.repeat(8, 1, 1),
                                                b.repeat(8, 1, 1), ops.MOE_MAX_TOP_K + 1),
                        "top_k must be in \\[1, "),
    "too_many_experts": (lambda x, lg, a, b, k: (x, torch.zeros(5, ops.MOE_MAX_NUM_EXPERTS + 1),
                                                 a, b, k), "expert count E"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_arguments(name: str) -> None:
    change, match = BAD[name]
    x, logits, w13, w2 = _valid()
    args = change(x, logits, w13, w2, 2)
    before = [bits(t) for t in args[:4]]
    with pytest.raises(RuntimeError, match=f"fused_moe: .*{match}"):
        ops.fused_moe(*args, True)
    for t, b in zip(args[:4], before):
        assert torch.equal(bits(t), b)


@cuda_mark
@pytest.mark.parametrize("moved", [1, 2, 3])
def test_mixed_devices(moved: int) -> None:
    """One of router_logits, w13, w2 on the CPU, the rest on the GPU."""
    args = _valid("cuda")
    args[moved] = args[moved].cpu()
    name = ("hidden", "router_logits", "w13", "w2")[moved]
    with pytest.raises(RuntimeError, match=f"fused_moe: {name} is on cpu but hidden is on cuda"):
        ops.fused_moe(*args, 2, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bad_packed(dtype: torch.dtype) -> None:
    x, logits, w13, w2, _ = make_case(Case(8, 2, 5, 32, 40), dtype, seed=1)  # 2 gated panels
    p13, p2 = ops.pack_moe_weights(w13, w2)
    with pytest.raises(RuntimeError, match="fused_moe: w13 must be the packed"):
        ops.fused_moe(x, logits, p13[:, :1].contiguous(), p2, 2, True)
    wide = ops.pack_moe_weights(w13, torch.cat([w2, w2], 1))[1]  # H 64: 2 panels, not 1
    with pytest.raises(RuntimeError, match="fused_moe: w2 must be the packed"):
        ops.fused_moe(x, logits, p13, wide, 2, True)
    narrow = ops.pack_moe_weights(w13[:, :32], w2[:, :, :16].contiguous())[1]  # I 16: 1 panel
    with pytest.raises(RuntimeError, match="fused_moe: w13 must be the packed .* I = 16"):
        ops.fused_moe(x, logits, p13, narrow, 2, True)
    with pytest.raises(RuntimeError, match="fused_moe: w13 must be 3-D"):
        ops.fused_moe(x, logits, p13, w2, 2, True)  # one packed, one not
    with pytest.raises(RuntimeError, match="fused_moe: packed weights are float32 or bfloat16"):
        ops.fused_moe(x.half(), logits, p13.half(), p2.half(), 2, True)
    with pytest.raises(ValueError, match="pack_moe_weights: w13 must be"):
        ops.pack_moe_weights(w13[0], w2)


@cuda_mark
def test_cuda_refuses_packed_weights() -> None:
    x, logits, w13, w2 = _valid()
    p13, p2 = ops.pack_moe_weights(w13, w2)
    with pytest.raises(RuntimeError, match="fused_moe: w13 must be 3-D"):
        ops.fused_moe(x.cuda(), logits.cuda(), p13.cuda(), p2.cuda(), 2, True)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_opcheck(device: str, packed: bool) -> None:
    if packed and device == "cuda":
        pytest.skip("packed weights are the CPU kernel's form")
    x, logits, w13, w2 = _valid()
    if packed:
        w13, w2 = ops.pack_moe_weights(w13, w2)
    w13[torch.isnan(w13)] = 0  # opcheck compares outputs with its own reruns: no NaN inputs
    w2[torch.isnan(w2)] = 0
    args = tuple(t.to(device) for t in (x, logits, w13, w2)) + (2, True)
    torch.library.opcheck(torch.ops.vllm_lite.fused_moe.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))
