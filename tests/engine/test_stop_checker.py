"""StopChecker: the one place a sequence's stop is decided, against plain references."""

from __future__ import annotations

import random

import pytest

from vllm_lite.engine.stop_checker import StopChecker
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceStatus

EOS = 2


def _reference_token(params: SamplingParams, token: int, output_len: int, seq_len: int,
                     max_model_len: int):
    # The rules in vLLM's order: min_tokens gates EOS and stop ids; then the length limits.
    if output_len >= params.min_tokens and not params.ignore_eos and token == EOS:
        return SequenceStatus.FINISHED_STOPPED, None
    if output_len >= params.min_tokens and token in params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED, token
    if params.max_tokens is not None and output_len >= params.max_tokens:
        return SequenceStatus.FINISHED_LENGTH_CAPPED, None
    if seq_len > max_model_len:
        return SequenceStatus.FINISHED_LENGTH_CAPPED, None
    return None


def test_token_rules_match_the_reference() -> None:
    rng = random.Random()
    for _ in range(2000):
        max_model_len = rng.randint(4, 40)
        max_tokens = rng.choice([None, rng.randint(1, 20)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(5, max_tokens or 5)),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(8), rng.randint(0, 3)))
        checker = StopChecker(max_model_len)
        token = rng.randrange(8)
        output_len = rng.randint(1, 25)
        seq_len = output_len + rng.randint(1, 20)
        assert checker.check_token(params, EOS, token, output_len, seq_len) == \
            _reference_token(params, token, output_len, seq_len, max_model_len)


def test_no_eos_token_never_stops_on_eos() -> None:
    assert StopChecker(100).check_token(SamplingParams(), None, EOS, 1, 5) is None


def test_max_output_len() -> None:
    checker = StopChecker(10)
    assert checker.max_output_len(SamplingParams(max_tokens=None), 4) == 7
    assert checker.max_output_len(SamplingParams(max_tokens=3), 4) == 3
    assert checker.max_output_len(SamplingParams(max_tokens=30), 4) == 7


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_found_incrementally_as_in_the_whole_text(include: bool) -> None:
    """Text arrives in random chunks; the checker looks only at the tail each time. It must
    stop at the first chunk whose text holds a stop string, keeping what the reference
    (a search of the whole text so far) keeps."""
    rng = random.Random()
    alphabet = "ab c"
    for _ in range(500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        text, pos, got = "", 0, None
        while pos < len(full) and got is None:
            step = rng.randint(1, 5)
            chunk = full[pos:pos + step]
            pos += len(chunk)
            text += chunk
            got = StopChecker.check_stop_strings(params, text, len(chunk))
            if got is not None:
                # Reference: the first stop (in list order) present in the text so far.
                stop = next(s for s in stops if s in text)
                idx = text.find(stop)
                assert got == (stop, idx + len(stop) if include else idx), (stops, text)
            else:
                assert not any(s in text for s in stops), (stops, text)


def test_no_stop_strings_or_no_new_text() -> None:
    assert StopChecker.check_stop_strings(SamplingParams(), "abc", 3) is None
    assert StopChecker.check_stop_strings(SamplingParams(stop=["b"]), "abc", 0) is None
