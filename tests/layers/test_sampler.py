"""The sampler against plain float64 references (loops over a small vocabulary)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence as Seq

import pytest
import torch

from vllm_lite.layers import sampler as sampler_mod
from vllm_lite.layers.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    beam_search_candidates,
    compute_prompt_logprobs,
    first_argmax,
    inverse_cdf_sample,
    process_logits,
)
from vllm_lite.errors import InternalError
from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import Sequence, SequenceGroup

NEG_INF = -math.inf
EOS = 2


# ----------------------------------------------------------------------------------------
# Plain references: one row, python floats (float64), loops over the vocabulary.
# ----------------------------------------------------------------------------------------


def ref_softmax(x: list[float]) -> list[float]:
    m = max(x)
    if m == NEG_INF:
        raise AssertionError("row fully masked")
    e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_log_softmax(x: list[float]) -> list[float]:
    m = max(x)
    s = sum(math.exp(v - m) for v in x if v != NEG_INF)
    return [v - m - math.log(s) if v != NEG_INF else NEG_INF for v in x]


def ref_min_tokens(x, p: SamplingParams, output, eos):
    x = list(x)
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids)
        if eos is not None and not p.ignore_eos:
            banned.add(eos)
        for t in banned:
            x[t] = NEG_INF
    return x


def ref_penalties(x, p: SamplingParams, prompt, output):
    x = list(x)
    for t in range(len(x)):
        count = sum(1 for o in output if o == t)
        if t in prompt or count > 0:
            if x[t] > 0:
                x[t] = x[t] / p.repetition_penalty
            else:
                x[t] = x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count
        if count > 0:
            x[t] -= p.presence_penalty
    return x


def ref_temperature(x, p: SamplingParams):
    t = p.temperature if p.temperature >= 1e-5 else 1.0
    return [v / t for v in x]


def ref_top_k(x, k):
    if k <= 0 or k >= len(x):
        return list(x)
    kth = sorted(x, reverse=True)[k - 1]
    return [v if v >= kth else NEG_INF for v in x]


def ref_top_p(x, top_p):
    if top_p >= 1.0:
        return list(x)
    probs = ref_softmax(x)
    order = sorted(range(len(x)), key=lambda t: -x[t])
    mass_before = 0.0
    threshold = None
    for n, t in enumerate(order):
        if n > 0 and mass_before >= top_p:
            break
        threshold = x[t]
        mass_before += probs[t]
    # Every token tied with the last one the nucleus needs is kept.
    return [v if v >= threshold else NEG_INF for v in x]


def ref_min_p(x, min_p):
    probs = ref_softmax(x)
    top = max(probs)
    return [v if probs[t] >= min_p * top else NEG_INF for t, v in enumerate(x)]


def ref_process(x, p: SamplingParams, prompt, output, eos=EOS):
    x = ref_min_tokens(x, p, output, eos)
    x = ref_penalties(x, p, prompt, output)
    x = ref_temperature(x, p)
    x = ref_top_k(x, p.top_k)
    x = ref_top_p(x, p.top_p)
    x = ref_min_p(x, p.min_p)
    return x


def assert_rows_close(got: torch.Tensor, want: list[list[float]], tol=1e-5):
    got_l = got.double().tolist()
    for i, (g_row, w_row) in enumerate(zip(got_l, want)):
        for t, (g, w) in enumerate(zip(g_row, w_row)):
            if w == NEG_INF or g == NEG_INF:
                assert g == w, f"row {i} token {t}: got {g}, want {w}"
            else:
                assert abs(g - w) <= tol * max(1.0, abs(w)), f"row {i} token {t}: {g} vs {w}"


def make_row(params, prompt=(0, 1), output=(), seq_id=0, request_id=None, num_samples=1,
             eos=EOS):
    return SamplingRow(
        seq_id=seq_id,
        request_id=str(seq_id) if request_id is None else request_id,
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_id=eos,
        num_samples=num_samples,
    )


def check_processing(logits: torch.Tensor, rows: list[SamplingRow]):
    got = process_logits(logits, SamplingMetadata(rows))
    want = [
        ref_process(logits[i].double().tolist(), r.params, r.prompt_token_ids,
                    r.output_token_ids, r.eos_token_id)
        for i, r in enumerate(rows)
    ]
    assert_rows_close(got, want)
    return got


# ----------------------------------------------------------------------------------------
# Processors
# ----------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids():
    V = 12
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    rows = [
        make_row(SamplingParams(min_tokens=3, stop_token_ids=[5, 7]), output=[1, 1], seq_id=0),
        make_row(SamplingParams(min_tokens=3, stop_token_ids=[5, 7]), output=[1, 1, 1], seq_id=1),
        make_row(SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True), output=[], seq_id=2),
        make_row(SamplingParams(min_tokens=0, stop_token_ids=[5]), output=[], seq_id=3),
        make_row(SamplingParams(min_tokens=1), output=[], seq_id=4, eos=None),
    ]
    got = check_processing(logits, rows)
    inf = torch.isinf(got)
    assert inf[0].nonzero().flatten().tolist() == [EOS, 5, 7]
    assert not inf[1].any()  # min_tokens reached
    assert inf[2].nonzero().flatten().tolist() == [5]  # ignore_eos keeps EOS
    assert not inf[3].any()
    assert not inf[4].any()  # no EOS known, no stop ids


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=-0.4),
        dict(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=0.75),
    ],
)
def test_penalties_match_reference(kw):
    V = 16
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    logits = torch.randn(4, V, generator=g) * 3
    rows = []
    for i in range(4):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 8))] + [3, 3]
        rows.append(make_row(SamplingParams(**kw), prompt=prompt, output=output, seq_id=i))
    # One row without penalties in the same batch stays untouched.
    logits = torch.cat([logits, torch.randn(1, V, generator=g)])
    rows.append(make_row(SamplingParams(), prompt=[1, 2, 3], output=[3, 4], seq_id=9))
    got = check_processing(logits, rows)
    assert torch.equal(got[4], logits[4])
    assert not torch.equal(got[0], logits[0])


def test_penalties_ids_outside_vocab_duplicates_and_nothing_seen():
    V = 40
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, V, generator=g) * 3
    logits[0, 5] = 0.0  # neither side of the > 0 split
    kw = dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    rows = [
        make_row(SamplingParams(**kw), prompt=[5, -1, V, 5, V + 7], output=[9, 9, 9, 39], seq_id=0),
        make_row(SamplingParams(**kw), prompt=[], output=[], seq_id=1),
        make_row(SamplingParams(**kw), prompt=[V, -3], output=[V + 1], seq_id=2),
        make_row(SamplingParams(**kw), prompt=[0, 39], output=[0, 0, 39], seq_id=3),
    ]
    got = check_processing(logits, rows)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[2], logits[2])
    changed = (got[0] != logits[0]).nonzero().flatten().tolist()
    assert changed == [9, 39]  # 5 is 0.0: divided or multiplied, it stays 0


@pytest.fixture(params=["sort", "candidates"])
def top_candidates(request, monkeypatch):
    """Runs a top_k / top_p test through the full sort and through the candidates path
    (two candidates first, so small vocabularies take the fast path too)."""
    if request.param == "candidates":
        monkeypatch.setattr(sampler_mod, "_TOP_CANDIDATES", 2)
    else:
        monkeypatch.setattr(sampler_mod, "_TOP_CANDIDATES_MAX", 0)
    return request.param


def test_top_k_top_p_candidates_match_sort_and_float64(monkeypatch):
    """Large rows (bfloat16-rounded logits, so ties everywhere) through every route: first
    round, second round (16x), full sort; each row's kept set equals the float64
    reference's."""
    V = 4096
    monkeypatch.setattr(sampler_mod, "_TOP_CANDIDATES", 16)
    routes = {"candidates": 0, "sorted": 0}
    cand, srt = sampler_mod._top_k_top_p_candidates, sampler_mod._top_k_top_p_sorted

    def spy_cand(logits, *a):
        routes["candidates"] += logits.shape[0]
        return cand(logits, *a)

    def spy_sort(logits, *a):
        routes["sorted"] += logits.shape[0]
        return srt(logits, *a)

    monkeypatch.setattr(sampler_mod, "_top_k_top_p_candidates", spy_cand)
    monkeypatch.setattr(sampler_mod, "_top_k_top_p_sorted", spy_sort)
    g = torch.Generator().manual_seed(21)
    rng = random.Random(21)
    # top_p inside a top_k cut, where the mass past the k best must not count, then
    # random combinations, flat to peaked.
    combos = [(100, 0.5, 3.0), (16, 0.7, 4.0), (100, 0.7, 4.0), (7, 0.9, 6.0),
              (16, 0.5, 3.0), (-1, 0.9, 0.05)]
    for _ in range(20):
        combos.append((rng.choice([-1, 1, 7, 16, 100, V]), rng.choice([1.0, 0.5, 0.9, 0.99, 1e-6]),
                       rng.choice([0.05, 1.0, 4.0, 12.0])))
    rows = [make_row(SamplingParams(top_k=k, top_p=p), seq_id=i)
            for i, (k, p, _) in enumerate(combos)]
    scales = [c[2] for c in combos]
    logits = (torch.randn(len(rows), V, generator=g)
              * torch.tensor(scales).unsqueeze(1)).bfloat16().float()
    logits[::5, :300] = -math.inf  # rows min_tokens / earlier cuts left short
    got = check_processing(logits, rows)
    assert routes["sorted"] > 0 and routes["candidates"] > len(rows)  # every route taken
    sorted_path = sampler_mod._top_k_top_p_sorted(
        logits,
        torch.tensor([r.params.top_k if 0 < r.params.top_k < V else V for r in rows]),
        torch.tensor([r.params.top_p if r.params.top_p < 1 else math.inf for r in rows]))
    assert torch.equal(torch.isfinite(got), torch.isfinite(sorted_path))


def test_temperature_matches_reference():
    V = 10
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    rows = [make_row(SamplingParams(temperature=t), seq_id=i) for i, t in enumerate([0.5, 1.7, 0.0])]
    got = check_processing(logits, rows)
    assert torch.equal(got[2], logits[2])  # greedy: divided by 1


def test_top_k_keeps_ties_at_boundary(top_candidates):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.0, 2.0, -1.0]])
    for k, kept in [(1, [1]), (2, [1, 3, 4, 5]), (4, [1, 3, 4, 5]), (5, [1, 2, 3, 4, 5]),
                    (7, list(range(7))), (-1, list(range(7)))]:
        rows = [make_row(SamplingParams(top_k=k))]
        got = check_processing(logits, rows)
        assert torch.isfinite(got[0]).nonzero().flatten().tolist() == kept, k


def test_top_p_boundary_and_ties(top_candidates):
    # probs ~ [0.687, 0.093, 0.093, 0.093, 0.034]: p=0.75 needs token 0 and one of the
    # tied tokens; every tied token is kept whatever order the sort leaves them in.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    for p, kept in [(0.5, [0]), (0.6869, [0]), (0.75, [0, 1, 2, 3]), (0.99, [0, 1, 2, 3, 4]),
                    (1.0, [0, 1, 2, 3, 4]), (1e-6, [0])]:
        got = check_processing(logits, [make_row(SamplingParams(top_p=p))])
        assert torch.isfinite(got[0]).nonzero().flatten().tolist() == kept, p
    # The top token tied: a tiny top_p still keeps both (at least one token, ties kept).
    logits = torch.tensor([[2.0, 2.0, 0.0, -5.0]])
    got = check_processing(logits, [make_row(SamplingParams(top_p=1e-6))])
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [0, 1]
    # top_p applies to the top_k-truncated distribution.
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0]])
    check_processing(logits, [make_row(SamplingParams(top_k=3, top_p=0.8))])


def test_top_p_float_mass_does_not_drop_tail_when_disabled(top_candidates):
    # Tiny-probability tail: top_p=1 must keep every token even if float cumsum hits 1.
    logits = torch.tensor([[30.0] + [-30.0 - 0.01 * i for i in range(20)]])
    got = process_logits(logits, SamplingMetadata([make_row(SamplingParams(top_k=20))]))
    assert torch.isfinite(got).sum() == 20


def test_min_p_matches_reference():
    V = 20
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    rows = [make_row(SamplingParams(min_p=m), seq_id=i) for i, m in enumerate([0.0, 0.05, 0.3, 1.0])]
    got = check_processing(logits, rows)
    assert torch.isfinite(got[3]).sum() == 1  # min_p=1: only the top token


def test_random_combinations_match_reference(top_candidates):
    V = 24
    rng = random.Random(4)
    g = torch.Generator().manual_seed(4)
    rows = []
    for i in range(40):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.3, 1.0, 1.8]),
            top_k=rng.choice([-1, 1, 3, 10]),
            top_p=rng.choice([1.0, 0.9, 0.5, 0.2]),
            min_p=rng.choice([0.0, 0.1, 0.4]),
            repetition_penalty=rng.choice([1.0, 1.2, 0.8]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.3]),
            min_tokens=rng.choice([0, 2]),
            stop_token_ids=rng.choice([[], [7]]),
        )
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
        rows.append(make_row(params, prompt=prompt, output=output, seq_id=i))
    logits = torch.randn(len(rows), V, generator=g) * 2
    got = check_processing(logits, rows)
    assert torch.isfinite(got).any(dim=1).all()


def test_input_logits_untouched():
    logits = torch.randn(2, 8)
    before = logits.clone()
    rows = [make_row(SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0), seq_id=0),
            make_row(SamplingParams(min_tokens=2), seq_id=1)]
    Sampler(seed=0)(logits, SamplingMetadata(rows))
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -2.0, -0.5, -3.0]])
    rows = [make_row(SamplingParams(temperature=0.0), seq_id=i) for i in range(3)]
    out = Sampler()(logits, SamplingMetadata(rows))
    assert [o.token_ids for o in out.outputs] == [[1], [0], [2]]


def _plant_ties(x: torch.Tensor, gen: torch.Generator) -> None:
    """Copies each row's maximum to a few random ids, and to ids 0 / V-1 in some rows."""
    rows, vocab = x.shape
    m = x.amax(dim=-1, keepdim=True)
    ids = torch.randint(0, vocab, (rows, 3), generator=gen)
    x.scatter_(1, ids, m.expand(-1, 3))
    x[0::3, -1] = m[0::3, 0]
    x[1::3, 0] = m[1::3, 0]


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 2), (31, 49152), (7, 1000), (2, 70001)])
def test_first_argmax_is_torch_argmax(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    for scale in (1.0, 1e-30, 1e30):
        x = torch.randn(rows, vocab, generator=gen) * scale
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
        if vocab > 1:
            _plant_ties(x, gen)
            x[:, vocab // 2] = -math.inf  # cut tokens (top_k, min_tokens) are -inf
            assert torch.equal(first_argmax(x), x.argmax(dim=-1))


def test_first_argmax_odd_rows_follow_torch():
    x = torch.randn(5, 300)
    x[1, 17] = float("nan")
    x[2] = -math.inf
    x[3, 40] = math.inf
    x[4, [3, 9]] = math.inf
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    for other in (x.double(), x.bfloat16(), x[:, ::2]):
        assert torch.equal(first_argmax(other), other.argmax(dim=-1))


def test_inverse_cdf_sample_against_float64():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 500, generator=gen) ** 4
    probs[probs < 0.05] = 0.0  # many tokens cut
    probs /= probs.sum(dim=-1, keepdim=True)
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    got = inverse_cdf_sample(probs, u)
    p64 = probs.double()
    cdf = p64.cumsum(dim=-1)
    target = u * cdf[:, -1]
    for i, t in enumerate(got.tolist()):
        assert probs[i, t] > 0
        lo = cdf[i, t - 1].item() if t else 0.0
        # The token's float64 interval holds the target, up to the float32 sums' rounding.
        assert lo - 1e-5 <= target[i].item() < cdf[i, t].item() + 1e-5, (i, t)


def test_inverse_cdf_sample_extremes_never_draw_cut_tokens():
    probs = torch.zeros(4, 10)
    probs[:, 2:5] = torch.tensor([0.2, 0.5, 0.3])  # ids 0-1 and 5-9 cut
    probs[3] = 0.0
    probs[3, 9] = 1.0
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.2, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [2, 4, 3, 9]


def test_greedy_large_vocab_with_ties_and_temperature_rows():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(31, 49152, generator=gen) * 4
    _plant_ties(logits, gen)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.8)
              for i in range(31)]
    rows = [make_row(p, seq_id=i) for i, p in enumerate(params)]
    out = Sampler(seed=0)(logits, SamplingMetadata(rows))
    want = logits.argmax(dim=-1)
    lsm = torch.log_softmax(logits / torch.tensor(
        [1.0 if i % 2 else 0.8 for i in range(31)]).unsqueeze(1), dim=-1)
    for i, o in enumerate(out.outputs):
        if i % 2:
            assert o.token_ids == [int(want[i])]
        assert o.logprobs[0] == pytest.approx(float(lsm[i, o.token_ids[0]]), abs=1e-5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_plain_greedy_batch_matches_float64(dtype):
    """Every row plain greedy (the CPU fast path, ops.greedy_sample): tokens are the float64
    argmax (lowest id on ties) and logprobs its log_softmax, from logits in the model's
    dtype; no full logprobs tensor is built."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(31, 49152, generator=gen) * 4
    _plant_ties(logits, gen)
    logits = logits.to(dtype)
    rows = [make_row(SamplingParams(temperature=0.0, ignore_eos=i % 2 == 0), seq_id=i)
            for i in range(31)]
    out = Sampler(seed=0)(logits, SamplingMetadata(rows))
    assert out.logprobs is None  # the fast path ran
    x = logits.double()
    want = x.argmax(dim=-1)
    lsm = torch.log_softmax(x, dim=-1)
    assert [o.token_ids for o in out.outputs] == [[int(t)] for t in want]
    for i, o in enumerate(out.outputs):
        assert o.seq_id == i and o.top_logprobs is None
        assert o.logprobs[0] == pytest.approx(float(lsm[i, want[i]]), abs=1e-5)


@pytest.mark.parametrize("odd", [
    dict(temperature=0.8), dict(temperature=0.0, logprobs=0),
    dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.0, presence_penalty=0.5),
    dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.0, min_tokens=4),
])  # (greedy SamplingParams reset top_k / top_p / min_p themselves)
def test_one_row_that_is_not_plain_greedy_takes_the_general_path(odd):
    """One row with anything that changes its logits or asks for more: the whole batch
    goes the general way (full logprobs tensor), and the plain rows get the same tokens
    and logprobs either way."""
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(4, 300, generator=gen) * 3
    plain = [make_row(SamplingParams(temperature=0.0), prompt=[1, 2], output=[3], seq_id=i)
             for i in range(4)]
    fast = Sampler(seed=0)(logits, SamplingMetadata(plain))
    assert fast.logprobs is None
    mixed = plain[:3] + [make_row(SamplingParams(**odd), prompt=[1, 2], output=[3], seq_id=3)]
    out = Sampler(seed=0)(logits, SamplingMetadata(mixed))
    assert out.logprobs is not None
    for a, b in zip(fast.outputs[:3], out.outputs[:3]):
        assert a.token_ids == b.token_ids
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=1e-5)


@pytest.mark.parametrize("kind", ["greedy", "random", "logprobs", "best_of"])
def test_one_token_per_row_comes_as_columns(kind):
    """A step of one token per row and no logprob entries (plain greedy, or sampling)
    carries its samples as PlainSamples columns, and ``outputs`` made from them equals
    the per-row samples; a step with entries or several samples in a row has none."""
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(5, 300, generator=gen) * 3
    extra = {"greedy": dict(temperature=0.0), "random": dict(temperature=0.9, seed=3),
             "logprobs": dict(temperature=0.0, logprobs=2),
             "best_of": dict(temperature=0.9, n=1, best_of=2, seed=3)}[kind]
    rows = [make_row(SamplingParams(**extra), prompt=[1, 2], seq_id=10 + i,
                     num_samples=2 if kind == "best_of" and i == 0 else 1)
            for i in range(5)]
    out = Sampler(seed=0)(logits, SamplingMetadata(rows))
    if kind in ("logprobs", "best_of"):
        assert out.plain is None
        return
    p = out.plain
    assert p is not None and p.seq_ids == [10 + i for i in range(5)]
    assert all(type(t) is int for t in p.token_ids)
    lsm = torch.log_softmax(logits.double() / (0.9 if kind == "random" else 1.0), dim=-1)
    for i, (t, lp) in enumerate(zip(p.token_ids, p.logprobs)):
        assert lp == pytest.approx(float(lsm[i, t]), abs=1e-5)
    if kind == "greedy":
        assert p.token_ids == logits.argmax(dim=-1).tolist()
    assert [(o.seq_id, o.token_ids, o.logprobs, o.top_logprobs) for o in out.outputs] == \
        [(s, [t], [lp], None) for s, t, lp in zip(p.seq_ids, p.token_ids, p.logprobs)]
    # The same seeded draw through the per-row path: the same tokens.
    if kind == "random":
        again = Sampler(seed=0)(logits, SamplingMetadata(
            [make_row(SamplingParams(**extra), prompt=[1, 2], seq_id=10 + i)
             for i in range(5)]))
        assert again.plain.token_ids == p.token_ids


def test_plain_greedy_row_without_a_finite_maximum_follows_torch():
    """A NaN or +inf row: the fast path hands the batch back, and torch's argmax /
    log_softmax decide (NaN counts as the maximum; an inf row's logprob is NaN)."""
    logits = torch.randn(3, 40)
    logits[0, 9] = float("nan")
    logits[1, 17] = float("inf")
    rows = [make_row(SamplingParams(temperature=0.0), seq_id=i) for i in range(3)]
    out = Sampler(seed=0)(logits, SamplingMetadata(rows))
    assert out.logprobs is not None
    assert [o.token_ids[0] for o in out.outputs] == logits.argmax(dim=-1).tolist()


def test_greedy_and_random_rows_in_one_batch():
    V = 32
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, V, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, seed=11, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, min_p=0.2),
    ]
    rows = [make_row(p, prompt=[int(logits[i].argmax())], seq_id=i) for i, p in enumerate(params)]
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, SamplingMetadata(rows))
        processed = process_logits(logits, SamplingMetadata(rows))
        for i, (p, o) in enumerate(zip(params, out.outputs)):
            assert o.seq_id == i and len(o.token_ids) == 1
            tok = o.token_ids[0]
            if p.temperature == 0.0:
                assert tok == int(processed[i].argmax())
            else:
                assert math.isfinite(processed[i, tok].item())  # in the kept set


# ----------------------------------------------------------------------------------------
# Each row's plan (what the sampler derives from its params, made once per row): kept
# across steps, never stale
# ----------------------------------------------------------------------------------------


def test_min_tokens_expiring_on_a_kept_row():
    """A greedy row kept across steps (as the runner keeps it) has EOS and its stop ids
    masked while below min_tokens (the general path), and the plain path once min_tokens
    is reached: the decision follows the output, not the first step's."""
    V = 16
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(21))
    logits[0, EOS], logits[0, 9], logits[0, 6] = 9.0, 8.0, 7.0
    row = make_row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]))
    sampler = Sampler(seed=0)
    for step in range(4):
        out = sampler(logits, SamplingMetadata([row]))
        tok, lp = out.plain.token_ids[0], out.plain.logprobs[0]
        masked = logits[0].double().tolist()
        if step < 2:
            assert out.logprobs is not None and tok == 6  # EOS and stop id 9 masked
            masked[EOS] = masked[9] = NEG_INF
        else:
            assert out.logprobs is None and tok == EOS  # the plain greedy path
        assert lp == pytest.approx(ref_log_softmax(masked)[tok], abs=1e-5)
        row.output_token_ids.append(tok)


def test_a_row_given_other_params_follows_them():
    """The plan is kept with the params object it was made from: a row given other
    params (greedy -> greedy with logprobs -> random top_k=1 -> plain greedy again)
    samples as the new params say from the next step on."""
    V = 40
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(22))
    best = int(logits[0].argmax())
    row = make_row(SamplingParams(temperature=0.0))
    sampler = Sampler(seed=0)
    assert sampler(logits, SamplingMetadata([row])).logprobs is None
    row.params = SamplingParams(temperature=0.0, logprobs=2)
    out = sampler(logits, SamplingMetadata([row]))
    assert out.plain is None and out.outputs[0].token_ids == [best]
    check_logprob_dict(out.outputs[0].top_logprobs[0],
                       ref_log_softmax(logits[0].double().tolist()), best, 2)
    row.params = SamplingParams(temperature=1.0, top_k=1)
    out = sampler(logits, SamplingMetadata([row]))
    assert out.plain.token_ids == [best] and out.plain.logprobs == [0.0]  # the only token
    row.params = SamplingParams(temperature=0.0)
    assert sampler(logits, SamplingMetadata([row])).logprobs is None


def test_first_step_draws_then_one_a_step():
    """A best_of request's row draws best_of tokens at its first sample and one a step
    after (the runner makes a new row then: num_samples is fixed for a row's life); the
    request's generator carries on across the two rows."""
    params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=5)
    group = SequenceGroup("r", [Sequence(1, [3, 4])], params, eos_token_id=EOS)
    seq = group.get_seqs()[0]
    logits = torch.zeros(1, 50)  # uniform: every draw consumes the generator
    sampler = Sampler()
    first = SamplingRow.for_seq(group, seq)
    out = sampler(logits, SamplingMetadata([first]))
    assert first.num_samples == 3 and out.plain is None
    assert len(out.outputs[0].token_ids) == 3
    seq.output_token_ids.append(out.outputs[0].token_ids[0])
    later = SamplingRow.for_seq(group, seq)
    out2 = sampler(logits, SamplingMetadata([later]))
    assert later.num_samples == 1 and len(out2.plain.token_ids) == 1
    # The same four draws from one generator of the same seed, in one row.
    again = Sampler()(logits, SamplingMetadata([make_row(params, num_samples=4)]))
    assert again.outputs[0].token_ids == out.outputs[0].token_ids + out2.plain.token_ids


def test_rows_sharing_a_plan_keep_their_own_generators():
    """Requests with equal settings (one seed value) share a plan but each draws from its
    own generator: both draw what either draws alone; a row without a seed in the batch
    draws from the sampler's."""
    V = 50
    logits = torch.zeros(3, V)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0)]
    rows = [make_row(p, seq_id=i) for i, p in enumerate(params)]
    alone = make_row(SamplingParams(temperature=1.0, seed=7), seq_id=9)
    sampler, solo = Sampler(seed=0), Sampler(seed=0)
    for _ in range(5):
        got = sampler(logits, SamplingMetadata(rows)).plain.token_ids
        want = solo(logits[:1], SamplingMetadata([alone])).plain.token_ids[0]
        assert got[0] == got[1] == want


def test_mixed_batch_rows_sample_as_alone():
    """Greedy, seeded random (one and several draws), beam and logprob rows in one batch:
    each row's samples (and a beam request's candidates) are what the row gets alone."""
    V = 60
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(23)) * 2
    beam = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0)
    specs = [
        (SamplingParams(temperature=0.0), 1, "a"),
        (SamplingParams(n=1, best_of=3, temperature=0.9, seed=1), 3, "b"),
        (beam, 1, "c"),
        (SamplingParams(temperature=0.0, logprobs=3), 1, "d"),
        (beam, 1, "c"),  # the request's rows need not be next to each other
        (SamplingParams(temperature=0.7, seed=2, min_p=0.05), 1, "e"),
        (SamplingParams(temperature=0.0, min_tokens=1, presence_penalty=0.4), 1, "f"),
    ]

    def rows_of(idx):
        return [make_row(specs[i][0], prompt=[1, 2], seq_id=i, request_id=specs[i][2],
                         num_samples=specs[i][1]) for i in idx]

    out = Sampler(seed=0)(logits, SamplingMetadata(rows_of(range(7))))
    assert out.plain is None and out.outputs[2] is None and out.outputs[4] is None
    for i in (0, 1, 3, 5, 6):
        solo = Sampler(seed=0)(logits[i:i + 1], SamplingMetadata(rows_of([i]))).outputs[0]
        o = out.outputs[i]
        assert o.seq_id == i and o.token_ids == solo.token_ids
        assert o.logprobs == pytest.approx(solo.logprobs, abs=1e-6)
        assert (o.top_logprobs is None) == (solo.top_logprobs is None)
        if o.top_logprobs is not None:
            assert o.top_logprobs[0].keys() == solo.top_logprobs[0].keys()
    assert len(out.outputs[1].token_ids) == 3
    beams = Sampler(seed=0)(logits[[2, 4]], SamplingMetadata(rows_of([2, 4]))).beams
    assert [(c.parent_seq_id, c.token_id) for c in out.beams["c"]] == \
        [(c.parent_seq_id, c.token_id) for c in beams["c"]]


class ToyModel:
    """Deterministic logits from a sequence's token history."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def logits(self, tokens: Seq[int]) -> torch.Tensor:
        h = 0
        for t in tokens:
            h = (h * 1000003 + t + 1) % (2**31)
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(h))


def run_steps(batch: list[SamplingRow], steps: int, sampler: Sampler, model: ToyModel):
    for _ in range(steps):
        logits = torch.stack([model.logits(list(r.prompt_token_ids) + list(r.output_token_ids))
                              for r in batch])
        out = sampler(logits, SamplingMetadata(batch))
        for r, o in zip(batch, out.outputs):
            r.output_token_ids.append(o.token_ids[0])


def test_seeded_request_independent_of_batch_mates():
    model = ToyModel(50)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=100)

    def target():
        return make_row(params, prompt=[4, 5, 6], seq_id=100, request_id="target")

    alone = target()
    run_steps([alone], 20, Sampler(), model)

    for mates_seed, pos in [(0, 0), (1, 2), (2, 3)]:
        mates = [
            make_row(SamplingParams(temperature=1.0), prompt=[1], seq_id=1),
            make_row(SamplingParams(temperature=0.5, seed=99), prompt=[2, 3], seq_id=2,
                     request_id="other-seeded"),
            make_row(SamplingParams(temperature=0.0), prompt=[7], seq_id=3),
        ]
        t = target()
        batch = mates[:pos] + [t] + mates[pos:]
        torch.manual_seed(mates_seed)
        run_steps(batch, 20, Sampler(seed=mates_seed), model)
        assert t.output_token_ids == alone.output_token_ids

    other = make_row(SamplingParams(temperature=0.9, top_p=0.95, seed=4321), prompt=[4, 5, 6],
                     seq_id=100, request_id="target")
    run_steps([other], 20, Sampler(), model)
    assert other.output_token_ids != alone.output_token_ids


def test_generator_kept_across_steps_on_its_request():
    """A seeded request's generator lives on the request (row.request): kept across steps,
    shared by the request's rows, gone with the request (a new one starts over)."""
    V = 40
    logits = torch.zeros(1, V)  # uniform: each draw consumes the generator
    sampler = Sampler()
    row = make_row(SamplingParams(seed=7), request_id="r")
    draws = [sampler(logits, SamplingMetadata([row])).outputs[0].token_ids[0] for _ in range(10)]
    assert len(set(draws)) > 1  # the generator advanced, not re-seeded each step
    assert row.request.generator is not None
    again_row = make_row(SamplingParams(seed=7), request_id="r")  # a new request, same id
    again = [sampler(logits, SamplingMetadata([again_row])).outputs[0].token_ids[0]
             for _ in range(10)]
    assert again == draws
    # Two rows of one request draw from its one generator, in row order.
    a, b = make_row(SamplingParams(seed=7), seq_id=1), make_row(SamplingParams(seed=7), seq_id=2)
    b.request = a.request
    pair = sampler(torch.zeros(2, V), SamplingMetadata([a, b])).outputs
    assert [o.token_ids[0] for o in pair] == draws[:2]


def test_engine_seed_makes_unseeded_rows_reproducible():
    logits = torch.zeros(4, 100)
    rows = [make_row(SamplingParams(), seq_id=i) for i in range(4)]
    a = [o.token_ids for o in Sampler(seed=3)(logits, SamplingMetadata(rows)).outputs]
    b = [o.token_ids for o in Sampler(seed=3)(logits, SamplingMetadata(rows)).outputs]
    c = [o.token_ids for o in Sampler(seed=4)(logits, SamplingMetadata(rows)).outputs]
    assert a == b and a != c


def expected_probs(logits_row: torch.Tensor, params: SamplingParams) -> list[float]:
    x = ref_process(logits_row.double().tolist(), params, [], [])
    return ref_softmax(x)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_distribution_matches_processed_softmax(seeded):
    logits = torch.tensor([[2.0, 1.6, 1.5, 1.0, 0.7, 0.2, -0.5, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.08,
                            seed=21 if seeded else None)
    want = expected_probs(logits[0], params)
    assert sum(1 for p in want if p > 0) >= 3  # the combination leaves a real choice
    N = 20000
    if seeded:
        # One row drawing N samples (the best_of path) from the request's generator.
        out = Sampler()(logits, SamplingMetadata([make_row(params, num_samples=N)]))
        tokens = out.outputs[0].token_ids
    else:
        rows = [make_row(params, seq_id=i) for i in range(N)]
        out = Sampler(seed=5)(logits.expand(N, -1), SamplingMetadata(rows))
        tokens = [o.token_ids[0] for o in out.outputs]
    assert len(tokens) == N
    freq = [tokens.count(t) / N for t in range(logits.shape[1])]
    for t, (f, p) in enumerate(zip(freq, want)):
        if p == 0.0:
            assert f == 0.0, t
        assert abs(f - p) < 0.01, (t, f, p)


def test_num_samples_with_replacement_and_greedy_rejected():
    out = Sampler(seed=0)(torch.tensor([[0.0, 0.0]]),
                          SamplingMetadata([make_row(SamplingParams(n=2, best_of=4), num_samples=4)]))
    o = out.outputs[0]
    assert len(o.token_ids) == 4 and len(o.logprobs) == 4
    assert all(lp == pytest.approx(math.log(0.5)) for lp in o.logprobs)
    with pytest.raises(InternalError, match="num_samples"):  # the engine builds rows: a bug
        make_row(SamplingParams(temperature=0.0), num_samples=2)


def test_metadata_from_seq_groups():
    p = SamplingParams(n=2, best_of=3, seed=1)
    g1 = SequenceGroup("a", [Sequence(10, [1, 2])], p, eos_token_id=EOS)
    g2 = SequenceGroup("b", [Sequence(11, [3]), Sequence(12, [3])],
                       SamplingParams(n=2), eos_token_id=EOS)
    for s in g2.get_seqs():
        s.output_token_ids.append(5)
    md = SamplingMetadata.from_seq_groups([g1, g2])
    assert [(r.seq_id, r.request_id, r.num_samples) for r in md.rows] == [
        (10, "a", 3), (11, "b", 1), (12, "b", 1)]
    assert md.rows[1].output_token_ids == [5] and md.rows[0].eos_token_id == EOS


# ----------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------


def check_logprob_dict(d: dict, ref_lp: list[float], chosen: int, k: int):
    """d holds the chosen token (with its rank) and the top k tokens, each with its logprob."""
    k = min(k, len(ref_lp))
    assert chosen in d and len(d) in (k, k + 1)
    assert d[chosen].rank == 1 + sum(1 for v in ref_lp if v > ref_lp[chosen])
    # A cut token's -inf is reported as LOGPROB_FLOOR (finite, for JSON), as vLLM does.
    reported = [max(v, LOGPROB_FLOOR) for v in ref_lp]
    for t, lp in d.items():
        assert lp.logprob == pytest.approx(reported[t], abs=1e-5), t
    # The k largest entries are the k largest logprobs (robust to which tied ids topk picks;
    # an extra chosen token is never above the k-th).
    got_top = sorted((lp.logprob for lp in d.values()), reverse=True)[:k]
    assert got_top == pytest.approx(sorted(reported, reverse=True)[:k], abs=1e-5)


def test_logprobs_from_processed_logits():
    V = 30
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, V, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.6, logprobs=3, repetition_penalty=1.4, seed=3),
        SamplingParams(temperature=1.0, top_k=4, logprobs=6),  # beyond the kept set: -inf
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    rows = [make_row(p, prompt=[1, 2, 3], output=[4], seq_id=i) for i, p in enumerate(params)]
    out = Sampler(seed=0)(logits, SamplingMetadata(rows))
    for i, (p, o) in enumerate(zip(params, out.outputs)):
        ref_lp = ref_log_softmax(ref_process(logits[i].double().tolist(), p, [1, 2, 3], [4]))
        chosen = o.token_ids[0]
        assert o.logprobs[0] == pytest.approx(ref_lp[chosen], abs=1e-5)
        assert len(o.top_logprobs) == 1
        check_logprob_dict(o.top_logprobs[0], ref_lp, chosen, p.logprobs)
        assert torch.allclose(out.logprobs[i].double(),
                              torch.tensor(ref_lp, dtype=torch.float64), atol=1e-5)
    assert list(out.outputs[3].top_logprobs[0]) == [out.outputs[3].token_ids[0]]
    d2 = out.outputs[2].top_logprobs[0]
    assert sum(1 for lp in d2.values() if lp.logprob == LOGPROB_FLOOR) == 2  # 6 asked, 4 kept


def test_no_top_logprobs_unless_asked():
    out = Sampler()(torch.randn(1, 5), SamplingMetadata([make_row(SamplingParams(temperature=0))]))
    assert out.outputs[0].top_logprobs is None and len(out.outputs[0].logprobs) == 1


def test_prompt_logprobs_helper():
    V = 25
    prompt = [3, 9, 1, 1, 24, 0, 7]
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(len(prompt), V, generator=g)  # last row predicts past the prompt
    res = compute_prompt_logprobs(logits, prompt, 4)
    assert len(res) == len(prompt) and res[0] is None
    for pos in range(1, len(prompt)):
        ref_lp = ref_log_softmax(logits[pos - 1].double().tolist())
        check_logprob_dict(res[pos], ref_lp, prompt[pos], 4)

    # A chunk starting at position 3 gives positions 4.. and no leading None; params'
    # temperature and top_k apply (vLLM 0.6 processes prompt rows), penalties do not.
    p = SamplingParams(temperature=0.5, top_k=10, repetition_penalty=2.0, logprobs=2)
    chunk = compute_prompt_logprobs(logits[3:5], prompt, 2, params=p, start=3)
    assert len(chunk) == 2
    for j, pos in enumerate([4, 5]):
        plain = SamplingParams(temperature=0.5, top_k=10)
        ref_lp = ref_log_softmax(ref_process(logits[pos - 1].double().tolist(), plain, [], []))
        check_logprob_dict(chunk[j], ref_lp, prompt[pos], 2)
    assert compute_prompt_logprobs(logits[:1], [5], 3) == [None]


# ----------------------------------------------------------------------------------------
# Beam search
# ----------------------------------------------------------------------------------------


def brute_force_candidates(logprobs: list[list[float]], cum: list[float], beam_width: int):
    cands = []
    for b in range(len(logprobs)):
        for t in range(len(logprobs[b])):
            cands.append((cum[b] + logprobs[b][t], b, t))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(b, t, s) for s, b, t in cands[: 2 * beam_width]]


@pytest.mark.parametrize("num_beams,beam_width,vocab", [(1, 3, 20), (4, 4, 30), (3, 2, 5), (2, 8, 3)])
def test_beam_search_candidates_vs_brute_force(num_beams, beam_width, vocab):
    g = torch.Generator().manual_seed(num_beams * 100 + vocab)
    logprobs = torch.log_softmax(torch.randn(num_beams, vocab, generator=g), dim=-1)
    cum = (torch.rand(num_beams, generator=g) * -5).tolist()
    got = beam_search_candidates(logprobs, cum, beam_width)
    want = brute_force_candidates(logprobs.tolist(), cum, beam_width)
    assert [(b, t) for b, t, _ in got] == [(b, t) for b, t, _ in want]
    assert [s for _, _, s in got] == pytest.approx([s for _, _, s in want], abs=1e-5)


def test_beam_search_candidates_ties_lowest_beam_then_token():
    logprobs = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]]))
    got = beam_search_candidates(logprobs, [-1.0, -1.0], 2)
    want = brute_force_candidates(logprobs.tolist(), [-1.0, -1.0], 2)
    assert [(b, t) for b, t, _ in got] == [(b, t) for b, t, _ in want] == [(0, 2), (1, 0), (0, 0), (0, 1)]


def test_beam_rows_left_to_engine():
    p = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, logprobs=1)
    rows = [make_row(p, seq_id=0), make_row(SamplingParams(temperature=0.0), seq_id=1)]
    logits = torch.randn(2, 6)
    out = Sampler()(logits, SamplingMetadata(rows))
    assert out.outputs[0] is None and out.outputs[1].token_ids == [int(logits[1].argmax())]
    cands = beam_search_candidates(out.logprobs[:1], [0.0], 2)
    assert len(cands) == 4 and cands[0][1] == int(logits[0].argmax())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_processing_and_seeds_reproducible():
    V = 64
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, V, generator=g) * 2
    rows = [
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3), output=[5], seq_id=0),
        make_row(SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05, seed=3), seq_id=1),
        make_row(SamplingParams(temperature=1.0, min_tokens=2, presence_penalty=0.5), output=[1], seq_id=2),
        make_row(SamplingParams(temperature=1.0), seq_id=3),
    ]
    md = SamplingMetadata(rows)
    cpu = process_logits(logits, md)
    gpu = process_logits(logits.cuda(), md).cpu()
    assert torch.equal(torch.isinf(cpu), torch.isinf(gpu))
    assert torch.allclose(cpu[torch.isfinite(cpu)], gpu[torch.isfinite(gpu)], atol=1e-5)
    a = Sampler(seed=0)(logits.cuda(), md)
    b = Sampler(seed=0)(logits.cuda(), md)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].token_ids == [int(cpu[0].argmax())]
    for i, o in enumerate(a.outputs):
        assert math.isfinite(cpu[i, o.token_ids[0]].item())
