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


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"]
