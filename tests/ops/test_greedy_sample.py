"""greedy_sample against float64 argmax / log_softmax on every CPU ISA build: fresh random
logits in each float dtype, vocabularies that leave partial vectors, strided rows, ties
across lanes and in the tail, rows whose maximum is not finite, NaN-poisoned outputs; bad
arguments raise, naming the field, and write nothing; opcheck."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1, under a vector, a vector plus one, odd, the default model's, and past it by a tail.
VOCABS = (1, 7, 17, 33, 49152, 49157)


def reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the first index of each row's maximum, and its log_softmax."""
    x = logits.double()
    tokens = x.argmax(dim=-1)  # torch's argmax picks the lowest index among equal maxima
    lp = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, lp


def run_raw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on NaN / -7 poisoned outputs, so a row it skipped cannot pass."""
    rows = logits.shape[0]
    tokens = torch.full((rows,), -7, dtype=torch.long)
    lps = torch.full((rows,), float("nan"))
    torch.ops.vllm_lite.greedy_sample(logits, tokens, lps)
    return tokens, lps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_float64(isa, dtype, vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 13
    logits = (torch.randn(rows, vocab, generator=g) * 5).to(dtype)
    tokens, lps = run_raw(logits)
    want_t, want_lp = reference(logits)
    assert torch.equal(tokens, want_t)
    # float32 sums of ~vocab exps (relative 1e-6) and log: well inside 1e-5 absolute at
    # logprobs of -20 and above.
    assert torch.allclose(lps.double(), want_lp, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("vocab", (40, 49157))
def test_ties_take_the_lowest_id(isa, vocab) -> None:
    """Equal maxima in different vector lanes, in the same lane, and in the tail: the
    lowest id wins, as torch.argmax (the per-lane first-index bookkeeping would pick
    another id if it compared lanes wrongly)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g)
    top = float(logits.max()) + 1.0
    places = [(0, [5, 3]), (1, [16 + 3, 3 + 32]), (2, [vocab - 1, vocab - 2]),
              (3, [vocab - 1, 2]), (4, [37, 21, 36]), (5, [0, vocab - 1])]
    for r, cols in places:
        logits[r, cols] = top
    tokens, lps = run_raw(logits.to(torch.bfloat16))
    assert tokens.tolist() == [min(c) for _, c in places]
    want = reference(logits.to(torch.bfloat16))[1]
    assert torch.allclose(lps.double(), want, atol=1e-5)


def test_strided_rows(isa) -> None:
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(9, 300, generator=g).bfloat16()
    view = wide[::2, 10:250]  # row stride 600, 240 columns
    tokens, lps = run_raw(view)
    want_t, want_lp = reference(view)
    assert torch.equal(tokens, want_t)
    assert torch.allclose(lps.double(), want_lp, atol=1e-5)


def test_rows_without_a_finite_maximum(isa) -> None:
    """A NaN anywhere, +inf, or every logit -inf: -1 and NaN (the caller's cue to use
    torch); -inf beside a finite maximum is an ordinary zero-probability token."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g)
    logits[0, 20] = float("nan")
    logits[1, 49] = float("nan")  # in the tail of a 16-lane build
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    logits[4, :30] = float("-inf")
    tokens, lps = run_raw(logits)
    assert tokens[:4].tolist() == [-1] * 4 and lps[:4].isnan().all()
    want_t, want_lp = reference(logits[4:])
    assert torch.equal(tokens[4:], want_t)
    assert torch.allclose(lps[4:].double(), want_lp, atol=1e-5)


def test_extreme_spread_underflows_to_zero(isa) -> None:
    """Logits 1e30 apart: every other token's exp underflows; the maximum's logprob is 0."""
    logits = torch.full((2, 70), -1e30)
    logits[0, 66] = 1e30
    logits[1, 2] = 0.0
    tokens, lps = run_raw(logits)
    assert tokens.tolist() == [66, 2]
    assert lps.tolist() == [0.0, 0.0]


def test_wrapper_and_empty_batch() -> None:
    logits = torch.randn(3, 10)
    tokens, lps = ops.greedy_sample(logits)
    assert tokens.dtype == torch.long and lps.dtype == torch.float32
    assert torch.equal(tokens, logits.argmax(-1))
    t0, l0 = ops.greedy_sample(torch.empty(0, 10))
    assert t0.shape == (0,) and l0.shape == (0,)


def test_bad_arguments() -> None:
    x = torch.randn(3, 8)
    t, lp = torch.empty(3, dtype=torch.long), torch.empty(3)
    cases = [
        ((x.double(), t, lp), "logits must be float32, float16 or bfloat16"),
        ((x[0], t, lp), "logits must be 2-D"),
        ((torch.randn(8, 3).t(), t, lp), "logits.*contiguous"),
        ((torch.empty(3, 0), t, lp), "vocab must be in \\[1, 2\\^31\\)"),
        ((x, t.int(), lp), "token_ids must be Long"),
        ((x, t, lp.double()), "logprobs must be Float"),
        ((x, t[:2], lp), "token_ids must be \\[3\\]"),
        ((x, t, torch.empty(3, 2)), "logprobs must be \\[3\\]"),
        ((x, torch.empty(6, dtype=torch.long)[::2], lp), "token_ids must be contiguous"),
    ]
    for (logits, tokens, lps), message in cases:
        tokens.fill_(-7)
        lps.fill_(float("nan"))
        with pytest.raises(RuntimeError, match=f"greedy_sample: .*{message}"):
            torch.ops.vllm_lite.greedy_sample(logits, tokens, lps)
        assert (tokens == -7).all() and lps.isnan().all()


def test_opcheck() -> None:
    """Schema annotations match what the kernel writes; the fake impl traces."""
    args = (torch.randn(3, 20), torch.empty(3, dtype=torch.long), torch.empty(3))
    torch.library.opcheck(torch.ops.vllm_lite.greedy_sample.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))
