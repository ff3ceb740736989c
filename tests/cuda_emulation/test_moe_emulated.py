"""fused_moe's CUDA kernels (csrc/cuda/moe/), run on the CPU by the SIMT emulator, against
the float64 reference of tests/ops/test_fused_moe.py with its tolerances: float32,
float16 and bfloat16, router logits float32 or in the dtype, renormalised or not, expert
counts 4-64, top-k 1-8, experts no token chose (their weights NaN: never read), H and I
past one block of threads, router logits with exact ties (broken to the lower expert id).
Both GEMM paths: the SIMT kernels (planned for an sm_75 GPU) and, planned for sm_90, the
tensor-core kernels for float16 / bfloat16 (several 16-row tiles per expert, partial
tiles, K past a 32-wide step, N past a block's 64 columns); the cases they do not take
(float32, H or I not a multiple of 8, a misaligned hidden) on the SIMT kernels, the path
each took checked.
Router logits with a NaN or an infinity (NaN rows for those tokens only). More pairs than
the sort kernel's threads; under several schedule seeds (--full-grid), the
same output bit for bit whatever order the sort's atomics land in.
The output starts NaN (every element must be written); the inputs must come back
unchanged. Each case runs under every schedule seed of harness.seeds() (the first by
default, the others with --full-grid)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ops.reference import assert_bitwise_equal  # tests/ is on sys.path
from ops.test_fused_moe import (Case, check_close, check_non_finite, make_case,
                                non_finite_case, reference)

from . import harness
from .conftest import case_dir

pytestmark = pytest.mark.cuda_emulated

CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


SIMT, TENSOR_CORES = 0, 1  # csrc/cuda/moe/fused_moe_path.h's MoePath


@dataclass(frozen=True)
class EmuCase:
    moe: Case
    dtype: torch.dtype
    renormalize: bool
    f32_logits: bool
    cc: int = 75  # the GPU the launcher plans for
    path: int = SIMT  # the GEMM path it must take
    misaligned: bool = False  # hidden 2 bytes past a 16-byte boundary
    non_finite: bool = False  # tokens 0-2's logits NaN / inf (test_fused_moe.non_finite_case)

    @property
    def id(self) -> str:
        return (f"{self.moe.id}-{CODE[self.dtype]}-{'renorm' if self.renormalize else 'plain'}"
                f"-logits_{'f32' if self.f32_logits else 'same'}-sm{self.cc}"
                + ("-misaligned" if self.misaligned else "")
                + ("-non_finite" if self.non_finite else ""))


CASES = [
    EmuCase(Case(4, 1, 1, 32, 24), torch.float32, True, True),
    EmuCase(Case(8, 2, 7, 50, 40), torch.float16, False, False),
    EmuCase(Case(64, 8, 3, 32, 16), torch.bfloat16, True, False),  # most experts idle
    EmuCase(Case(16, 4, 33, 130, 136), torch.float32, False, False),  # H, I > one block
    EmuCase(Case(32, 2, 20, 64, 48), torch.bfloat16, False, True),
    EmuCase(Case(8, 3, 9, 32, 24, tied=True), torch.float32, True, False),  # ties: lower id
    # Tensor cores: 80 rows over 4 experts (two tiles each), K = 72 (a step and a chunk),
    # I = 40 (part of a block's columns).
    EmuCase(Case(4, 2, 40, 72, 40), torch.float16, True, True, 90, TENSOR_CORES),
    EmuCase(Case(64, 8, 3, 32, 16), torch.bfloat16, True, False, 80, TENSOR_CORES),
    EmuCase(Case(16, 4, 33, 136, 200), torch.bfloat16, False, True, 90, TENSOR_CORES),
    EmuCase(Case(8, 3, 9, 64, 24, tied=True), torch.float16, False, False, 90, TENSOR_CORES),
    # ... and what they leave to the SIMT kernels on the same GPU.
    EmuCase(Case(8, 2, 7, 50, 40), torch.float16, False, False, 90),  # H % 8 != 0
    EmuCase(Case(4, 2, 9, 64, 36), torch.bfloat16, True, False, 90),  # I % 8 != 0
    EmuCase(Case(16, 4, 33, 64, 48), torch.float32, False, False, 90),
    EmuCase(Case(4, 2, 9, 64, 40), torch.float16, True, False, 90, misaligned=True),
    # More pairs than the sort kernel's threads (each takes two or three), on both paths.
    EmuCase(Case(16, 8, 130, 32, 16), torch.bfloat16, True, False, 90, TENSOR_CORES),
    EmuCase(Case(64, 2, 300, 24, 16), torch.float32, False, True),
    # The routing warp: every lane holding 16 experts (the most), and ties across lanes with
    # an expert count that is not a multiple of 32.
    EmuCase(Case(512, 8, 12, 32, 16), torch.float16, True, True, 90, TENSOR_CORES),
    EmuCase(Case(100, 6, 25, 24, 16, tied=True), torch.float32, False, False),
    # Non-finite logits: NaN rows for those tokens only, every expert id still in range.
    EmuCase(Case(64, 8, 20, 32, 24), torch.bfloat16, True, True, 90, TENSOR_CORES,
            non_finite=True),
    EmuCase(Case(16, 3, 9, 24, 16), torch.float32, False, False, non_finite=True),
]


def _prepare(c: EmuCase, root):
    seed = c.moe.tokens * 13 + c.moe.experts
    if c.non_finite:
        x, logits, w13, w2, ref = non_finite_case(c.moe, c.dtype, seed, c.renormalize)
        idle = None
    else:
        x, logits, w13, w2, idle = make_case(c.moe, c.dtype, seed)
    if c.f32_logits:
        logits = logits.float()
    if not c.non_finite:
        ref = reference(x, logits, w13, w2, c.moe.top_k, c.renormalize)
    out = torch.full((c.moe.tokens, c.moe.hidden), float("nan"), dtype=c.dtype)
    cd = case_dir(root, c.id)
    m = c.moe
    cd.set(op="fused_moe", dtype=CODE[c.dtype], tokens=m.tokens, hidden=m.hidden,
           experts=m.experts, inter=m.inter, top_k=m.top_k, renormalize=int(c.renormalize),
           logits="f32" if c.f32_logits else "same", cc=c.cc)
    inputs = {"hidden": x, "router_logits": logits, "w13": w13, "w2": w2}
    for name, t in inputs.items():
        cd.buf(name, t, offset=2 if c.misaligned and name == "hidden" else 0, out=True)
    cd.buf("out", out, out=True)
    cd.buf("path", torch.full((1,), -1, dtype=torch.int32), out=True)
    cd.write()
    return cd, (inputs, out, ref, idle)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    want = harness.selected(request, "case")
    root = tmp_path_factory.mktemp("emu_moe")
    prepared = {c.id: _prepare(c, root) for c in CASES if c.id in want}
    results = harness.run_cases([cd.path for cd, _ in prepared.values()],
                                sorted(harness.selected(request, "seed")))
    return prepared, results


@pytest.mark.parametrize("seed", harness.seed_params())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fused_moe_emulated(runs, case: EmuCase, seed: int) -> None:
    prepared, results = runs
    cd, (inputs, out, ref, idle) = prepared[case.id]
    res = results[cd.path]
    assert res.ok, res.message
    assert int(cd.read("path", seed, torch.empty(1, dtype=torch.int32))) == case.path
    (check_non_finite if case.non_finite else check_close)(cd.read("out", seed, out), ref,
                                                             case.dtype)
    for name, t in inputs.items():
        assert_bitwise_equal(cd.read(name, seed, t), t, f"{name} must not be modified")
    if idle is not None and case.moe.experts > case.moe.top_k * case.moe.tokens:
        assert idle.any()


@pytest.mark.full_grid  # it needs the other schedule seeds, which only the full grid runs
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_output_does_not_depend_on_the_schedule(request, runs, case: EmuCase) -> None:
    """The sort kernel's atomics group an expert's rows in the order the threads run, which
    the schedule seed changes; the output must not change with it, bit for bit."""
    seeds = sorted(harness.selected(request, "seed"))
    if len(seeds) < 2:
        pytest.skip("one schedule seed ran (the others run with --full-grid)")
    prepared, results = runs
    cd, (_, out, _, _) = prepared[case.id]
    assert results[cd.path].ok, results[cd.path].message
    first = cd.read("out", seeds[0], out)
    for seed in seeds[1:]:
        assert_bitwise_equal(cd.read("out", seed, out), first, f"schedule seed {seed}")
