from __future__ import annotations

import math

import pytest

from vllm_lite.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1"),
        (dict(n=1.5), "n must be an int"),
        (dict(n=2, best_of=1), "best_of must be greater than or equal to n"),
        (dict(temperature=-0.1), "temperature must be non-negative"),
        (dict(temperature=math.nan), "temperature must be non-negative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), "top_k must be -1"),
        (dict(top_k=-2), "top_k must be -1"),
        (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(presence_penalty=2.5), "presence_penalty must be in"),
        (dict(frequency_penalty=-3.0), "frequency_penalty must be in"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens"),
        (dict(logprobs=-1), "logprobs must be non-negative"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be non-negative"),
        (dict(stop=["ok", ""]), "stop cannot contain an empty string"),
        (dict(stop=""), "stop cannot contain an empty string"),
        (dict(stop="x", detokenize=False), "stop strings are only supported when detokenize"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative ints"),
        (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling"),
        (dict(temperature=0.0, best_of=3), "best_of must be 1 when using greedy sampling"),
        (dict(use_beam_search=True, best_of=1, temperature=0.0), "best_of must be greater than 1 when using beam search"),
        (dict(use_beam_search=True, best_of=2, temperature=0.5), "temperature must be 0 when using beam search"),
        (dict(use_beam_search=True, best_of=2, temperature=0.0, top_k=5), "top_k must be -1 when using beam search"),
        (dict(length_penalty=0.5), "length_penalty is not effective"),
        (dict(early_stopping=True), "early_stopping is not effective"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.skip_special_tokens) == (16, 0, False, True)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.seed is None
    assert p.sampling_type == SamplingType.RANDOM


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(n=3).best_of == 3
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    # Greedy ignores the truncation knobs, as vLLM resets them.
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, -1, 0.0)
    assert greedy.sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    beam = SamplingParams(use_beam_search=True, best_of=4, temperature=0.0, length_penalty=0.7)
    assert beam.sampling_type == SamplingType.BEAM
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_n_above_the_configured_cap() -> None:
    SamplingParams(n=4).verify_max_n(4)
    with pytest.raises(ValueError, match="n must be at most 4"):
        SamplingParams(n=5).verify_max_n(4)
    with pytest.raises(ValueError, match="best_of must be at most 4"):
        SamplingParams(n=2, best_of=6).verify_max_n(4)


# -- admission hardening: every field is type-checked and every float is finite -----------

_INT_FIELDS = ["n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
               "prompt_logprobs", "truncate_prompt_tokens"]
_FLOAT_FIELDS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p", "length_penalty"]
_BOOL_FIELDS = ["use_beam_search", "include_stop_str_in_output", "ignore_eos", "detokenize",
                "skip_special_tokens", "spaces_between_special_tokens"]


def _raises_naming(field: str, **kwargs) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field), str(info.value)


@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("bad", ["3", 2.0, 1.5, True, False, [1], math.nan])
def test_int_fields_reject_other_types(field, bad) -> None:
    _raises_naming(field, **{field: bad})


@pytest.mark.parametrize("field", _FLOAT_FIELDS)
@pytest.mark.parametrize("bad", ["hot", "0.5", True, False, [0.5], b"1"])
def test_float_fields_reject_other_types(field, bad) -> None:
    _raises_naming(field, **{field: bad})


@pytest.mark.parametrize("field", _FLOAT_FIELDS)
def test_float_fields_reject_none(field) -> None:
    _raises_naming(field, **{field: None})


@pytest.mark.parametrize("field", _FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e308 * 10])
def test_float_fields_must_be_finite(field, bad) -> None:
    kwargs = {field: bad}
    if field == "length_penalty":  # only meaningful (and only checked past the default) under beam search
        kwargs.update(use_beam_search=True, best_of=2, temperature=0.0)
    _raises_naming(field, **kwargs)


def test_float_fields_accept_ints_and_store_floats() -> None:
    p = SamplingParams(temperature=1, top_p=1, min_p=0, presence_penalty=1,
                       frequency_penalty=-1, repetition_penalty=2)
    assert (p.temperature, p.top_p, p.presence_penalty, p.repetition_penalty) == (1, 1, 1, 2)
    assert all(type(getattr(p, f)) is float for f in _FLOAT_FIELDS)


@pytest.mark.parametrize("field", _BOOL_FIELDS)
@pytest.mark.parametrize("bad", ["yes", 1, 0, None, 1.0])
def test_bool_fields_reject_non_bools(field, bad) -> None:
    _raises_naming(field, **{field: bad})


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_early_stopping_is_a_bool_or_never(bad) -> None:
    _raises_naming("early_stopping", use_beam_search=True, best_of=2, temperature=0.0,
                   early_stopping=bad)
    for ok in (True, False, "never"):
        p = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, early_stopping=ok)
        assert p.early_stopping is ok or p.early_stopping == ok


@pytest.mark.parametrize("bad", [5, ["a", 3], [None], b"x", [b"x"], {"a": 1}, ["a", [""]]])
def test_stop_is_a_string_or_a_list_of_strings(bad) -> None:
    _raises_naming("stop", stop=bad)


def test_stop_accepts_tuples_and_lists() -> None:
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


@pytest.mark.parametrize("bad", [["a"], [1.0], [True], [-1], 5, "12", [None]])
def test_stop_token_ids_are_non_negative_ints(bad) -> None:
    _raises_naming("stop_token_ids", stop_token_ids=bad)


def test_seed_range_is_int64() -> None:
    import torch

    lo, hi = -(2**63), 2**63 - 1
    for seed in (lo, hi, 0, -1):
        p = SamplingParams(seed=seed)
        # Every accepted seed seeds a generator, and the two ends are distinct streams.
        torch.Generator().manual_seed(p.seed)
    a = torch.rand(4, generator=torch.Generator().manual_seed(lo))
    b = torch.rand(4, generator=torch.Generator().manual_seed(hi))
    assert not torch.equal(a, b)
    torch.tensor([lo, hi], dtype=torch.long)  # fits a long tensor too
    for seed in (hi + 1, 2**64, 2**64 - 1, lo - 1, -(2**64)):
        _raises_naming("seed", seed=seed)


def test_top_k_accepts_any_positive_int() -> None:
    # Values at or above the vocabulary mean "disabled"; the sampler clamps them.
    for k in (1, 2**31, 2**63 - 1, 2**63, 10**30):
        assert SamplingParams(top_k=k).top_k == k


def test_length_penalty_bound() -> None:
    beam = dict(use_beam_search=True, best_of=2, temperature=0.0)
    for lp in (-10.0, 10.0, 10, 0.0, -2.5):
        assert SamplingParams(length_penalty=lp, **beam).length_penalty == lp
    for lp in (10.001, -10.5, 1e308, -1e308):
        _raises_naming("length_penalty", length_penalty=lp, **beam)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_accept_zero_and_reject_negative(field) -> None:
    assert getattr(SamplingParams(**{field: 0}), field) == 0
    _raises_naming(field, **{field: -3})


def test_verify_max_logprobs() -> None:
    SamplingParams(logprobs=20, prompt_logprobs=20).verify_max_logprobs(20)
    SamplingParams().verify_max_logprobs(0)
    with pytest.raises(ValueError, match="^logprobs must be at most 20"):
        SamplingParams(logprobs=21).verify_max_logprobs(20)
    with pytest.raises(ValueError, match="^prompt_logprobs must be at most 5"):
        SamplingParams(prompt_logprobs=6).verify_max_logprobs(5)


def test_numpy_scalars_are_accepted_as_plain_numbers() -> None:
    np = pytest.importorskip("numpy")
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(7),
                       seed=np.int64(-5))
    assert (type(p.n), type(p.temperature), type(p.top_k), type(p.seed)) == (int, float, int, int)
    assert (p.n, p.best_of, p.top_k, p.seed) == (2, 2, 7, -5)
    _raises_naming("ignore_eos", ignore_eos=np.bool_(True))


def test_random_valid_params_round_trip() -> None:
    # Fresh random valid values are all accepted unchanged.
    import random

    rng = random.Random()
    for _ in range(200):
        kw = dict(n=rng.randint(1, 4), temperature=rng.uniform(0.1, 5.0),
                  top_p=rng.uniform(1e-3, 1.0), top_k=rng.choice([-1, rng.randint(1, 10**6)]),
                  min_p=rng.uniform(0, 1), presence_penalty=rng.uniform(-2, 2),
                  frequency_penalty=rng.uniform(-2, 2), repetition_penalty=rng.uniform(0.01, 5),
                  seed=rng.randint(-(2**63), 2**63 - 1), max_tokens=rng.randint(1, 10**6),
                  logprobs=rng.randint(0, 20), stop=[chr(rng.randint(97, 122))])
        p = SamplingParams(**kw)
        for k, v in kw.items():
            assert getattr(p, k) == v, k


def test_beam_score_never_raises() -> None:
    from vllm_lite.core.beam_search import beam_score

    lps = [1e308, -1e308, 400.0, -400.0, math.inf, -math.inf, math.nan, 0.0, 1.0, -44.0]
    lens = [0, 1, 2, 10**7, 10**400]
    cums = [0.0, -0.0, -1e-300, -3.5, -1e10, -math.inf, math.nan]
    for lp in lps:
        for n in lens:
            for cum in cums:
                s = beam_score(cum, n, lp)
                assert isinstance(s, float)
    # Past float range the score takes its limit: a huge penalty divisor -> -0.0, a tiny
    # one -> -inf; never a NaN from finite inputs.
    assert beam_score(-2.0, 10**7, 1e308) == 0.0
    assert beam_score(-2.0, 10**7, -1e308) == -math.inf
    assert beam_score(-2.0, 10**400, 1.0) == 0.0
    assert beam_score(-2.0, 10**400, -1.0) == -math.inf
    assert beam_score(0.0, 10**7, -1e308) == 0.0
    for lp in (1e308, -1e308, 2.0, -2.0):
        for n in (1, 3, 10**7, 10**400):
            assert not math.isnan(beam_score(-1.5, n, lp))


def test_beam_score_within_the_bound_is_the_plain_formula() -> None:
    import random

    from vllm_lite.core.beam_search import beam_score
    from vllm_lite.sampling_params import MAX_ABS_LENGTH_PENALTY

    rng = random.Random()
    for _ in range(500):
        lp = rng.uniform(-MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY)
        n = rng.randint(1, 10**7)
        cum = -rng.uniform(0, 1e4) * n
        s = beam_score(cum, n, lp)
        assert s == cum / (n ** lp) and math.isfinite(s)


def test_beam_score_zero_penalty_is_the_cumulative_logprob() -> None:
    from vllm_lite.core.beam_search import beam_score

    for n in (0, 1, 5, 10**400):
        assert beam_score(-3.25, n, 0.0) == -3.25


def test_output_kind_takes_the_enum_and_refuses_delta() -> None:
    from vllm_lite import RequestOutputKind

    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind \
        is RequestOutputKind.FINAL_ONLY
    for bad in (2, "FINAL_ONLY", None):
        _raises_naming("output_kind", output_kind=bad)
    with pytest.raises(ValueError, match="output_kind DELTA is not supported"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
