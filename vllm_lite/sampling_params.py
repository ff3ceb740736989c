"""Per-request sampling parameters, with vLLM 0.6's fields, defaults and checks."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import Literal

# Below this a temperature counts as zero: greedy sampling (the same bound as vLLM).
_SAMPLING_EPS = 1e-5

# Seeds are int64 values (vLLM's OpenAI protocol bounds them the same way). Every one fits
# a torch.long tensor, and torch.Generator.manual_seed, which takes [-2**63, 2**64 - 1] and
# wraps negatives into uint64, maps this range one-to-one onto its seeds.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1

# |length_penalty| bound. A beam's score is cumulative_logprob / output_len**length_penalty;
# with this bound output_len**length_penalty stays within [1e-70, 1e70] for any length up to
# 10**7 tokens, far from float64's overflow (1e308) and underflow (1e-308). Useful values
# are around [-2, 2] (HF's and vLLM's docs).
MAX_ABS_LENGTH_PENALTY = 10.0

_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
               "prompt_logprobs", "truncate_prompt_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs",
                        "truncate_prompt_tokens")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p", "length_penalty")
_BOOL_FIELDS = ("use_beam_search", "include_stop_str_in_output", "ignore_eos", "detokenize",
                "skip_special_tokens", "spaces_between_special_tokens")


class RequestOutputKind(enum.IntEnum):
    """When the engine's step returns a request's RequestOutput (vLLM's names and values).
    CUMULATIVE: after every step the request ran in, everything so far (streaming);
    FINAL_ONLY: once, when it finishes (LLM.generate: building the intermediate ones
    would be per-step work for outputs nobody reads). vLLM's DELTA (only the new part)
    is refused."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    n: completions returned. best_of: completions generated, the best n returned
    (defaults to n; the beam width under beam search). The penalties, temperature,
    top_p/top_k/min_p follow vLLM's meaning. stop: strings that end a completion (checked by
    the detokenizer); stop_token_ids: tokens that end it. max_tokens=None generates up to
    the model's max_model_len. Every check raises ValueError naming the field.

    Text: skip_special_tokens drops special tokens from the output text;
    spaces_between_special_tokens (vLLM's default True) joins the added / special tokens
    left in the text to their neighbours with a space, False with nothing (see
    vllm_lite.detokenizer.decode). truncate_prompt_tokens=k (an int >= 1, or None) keeps
    only the last k prompt tokens, applied where the prompt is admitted (LLM.generate /
    chat, the server) before the max_model_len check, as vLLM does; RequestOutput's
    prompt_token_ids are then the kept ones.
    output_kind (RequestOutputKind): whether the engine's step returns the request's
    RequestOutput after every step it ran in (CUMULATIVE) or only when it finishes
    (FINAL_ONLY; LLM.generate's requests).

    Types are checked first: int fields take ints (not bool or float; numpy integers are
    stored as int), float fields take ints or floats (not bool, str or None; stored as
    float, and every one must be finite), bool fields take bools only, stop a str or a
    list / tuple of non-empty strs, stop_token_ids a list / tuple of ints >= 0.
    Ranges beyond vLLM's: seed in [SEED_MIN, SEED_MAX] = [-2**63, 2**63 - 1] (int64;
    torch.Generator.manual_seed takes all of it); |length_penalty| <= 10
    (MAX_ABS_LENGTH_PENALTY: the length-penalised score can never overflow);
    top_k any int >= 1 or -1, a value at or above the vocabulary meaning "disabled" (the
    sampler clamps it). The engine's own limits (max_num_seqs for n / best_of,
    max_logprobs) are checked by verify_max_n / verify_max_logprobs.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._verify_types()
        if self.best_of is None:
            self.best_of = self.n
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _SAMPLING_EPS:
                # Greedy: the truncation knobs mean nothing, normalise them as vLLM does.
                self.top_p = 1.0
                self.top_k = -1
                self.min_p = 0.0
                self._verify_greedy_sampling()

    def _verify_types(self) -> None:
        """Types (and float finiteness) of every field, before any range check compares
        them; numbers are normalised to plain int / float, so that numpy scalars behave
        and nothing downstream sees a str or a bool."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and (name in _OPTIONAL_INT_FIELDS or name == "best_of"):
                continue
            setattr(self, name, _as_int(name, value))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{type(self.output_kind).__name__} {self.output_kind!r}")
        if self.output_kind is RequestOutputKind.DELTA:
            raise ValueError("output_kind DELTA is not supported: use CUMULATIVE (every "
                             "step's output holds everything so far) or FINAL_ONLY")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}"
            )

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than zero, "
                f"got {self.repetition_penalty}"
            )
        if not self.temperature >= 0.0:  # written so that NaN fails too
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                f"{MAX_ABS_LENGTH_PENALTY:g}], got {self.length_penalty}"
            )
        for name in _FLOAT_FIELDS:
            # The range checks above let +inf through for some fields (temperature).
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"seed must be in [-2**63, 2**63 - 1] (a 64-bit signed int), got {self.seed}"
            )
        if self.max_tokens is not None:
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
               for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.best_of}")
        if self.temperature > _SAMPLING_EPS:
            raise ValueError("temperature must be 0 when using beam search")
        if self.top_p < 1.0 - _SAMPLING_EPS:
            raise ValueError("top_p must be 1 when using beam search")
        if self.top_k != -1:
            raise ValueError("top_k must be -1 when using beam search")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}"
            )

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError("early_stopping is not effective and must be False when not using beam search")
        if abs(self.length_penalty - 1.0) > _SAMPLING_EPS:
            raise ValueError(
                "length_penalty is not effective and must be the default value of 1.0 when "
                "not using beam search"
            )

    def _verify_greedy_sampling(self) -> None:
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        if self.best_of > 1:
            raise ValueError(
                f"best_of must be 1 when using greedy sampling (temperature 0), got {self.best_of}"
            )

    def verify_max_n(self, max_n: int) -> None:
        """Reject a request that would run more sequences at once than the engine allows."""
        if self.best_of > max_n:
            name = "n" if self.best_of == self.n else "best_of"
            raise ValueError(
                f"{name} must be at most {max_n} (the configured max_num_seqs), "
                f"got {self.best_of}"
            )

    def verify_max_logprobs(self, max_logprobs: int) -> None:
        """Reject a request asking for more (prompt) logprobs than the engine allows."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(
                    f"{name} must be at most {max_logprobs} (the configured max_logprobs), "
                    f"got {value}"
                )

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass; n=True is a mistake, not 1. numpy's bool is no Integral.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (OverflowError, ValueError):  # a Fraction or int too large for a float
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
