"""Seeded benchmark workloads: token-id prompts with a requested output length each.

Every engine gets the very same requests (prompt token ids and output length), generated
once from a seed. Outputs run to their length whatever the tokens (``ignore_eos``), so
the work is fixed by the workload and not by what a model happens to generate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_range(name: str, value: tuple[int, int]) -> tuple[int, int]:
    if len(value) != 2:
        raise ValueError(f"{name} must be (min, max), got {value!r}")
    lo, hi = value
    if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) \
            or not isinstance(hi, int):
        raise ValueError(f"{name} must hold two ints, got {value!r}")
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must satisfy 1 <= min <= max, got {value!r}")
    return (lo, hi)


@dataclass(frozen=True)
class WorkloadConfig:
    """N requests; prompt and output lengths drawn uniformly from closed ranges.

    With ``shared_prefix_len`` > 0 every prompt starts with one of ``num_prefixes``
    random prefixes of that length (round robin), followed by its own random part drawn
    from ``input_len``: the prefix-caching workload.
    """

    num_requests: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    seed: int = 0
    shared_prefix_len: int = 0
    num_prefixes: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int) \
                or self.num_requests < 1:
            raise ValueError(f"num_requests must be a positive int, got {self.num_requests!r}")
        object.__setattr__(self, "input_len", _check_range("input_len", tuple(self.input_len)))
        object.__setattr__(self, "output_len", _check_range("output_len", tuple(self.output_len)))
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {self.num_prefixes}")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request of this workload can reach."""
        return self.shared_prefix_len + self.input_len[1] + self.output_len[1]

    def describe(self) -> str:
        text = (f"{self.num_requests} requests, input {self.input_len[0]}-{self.input_len[1]}, "
                f"output {self.output_len[0]}-{self.output_len[1]} tokens, seed {self.seed}")
        if self.shared_prefix_len:
            text += (f", {self.num_prefixes} shared prefix(es) of {self.shared_prefix_len} "
                     "tokens")
        return text


def make_workload(config: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    """The workload's requests, the same for a given config and vocabulary size."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = random.Random(config.seed)
    prefixes = [
        tuple(rng.randrange(vocab_size) for _ in range(config.shared_prefix_len))
        for _ in range(config.num_prefixes if config.shared_prefix_len else 0)
    ]
    requests = []
    for i in range(config.num_requests):
        prompt_len = rng.randint(*config.input_len)
        output_len = rng.randint(*config.output_len)
        own = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
        prefix = prefixes[i % len(prefixes)] if prefixes else ()
        requests.append(BenchRequest(prefix + own, output_len))
    return requests


def total_output_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.output_len for r in requests)


def total_prompt_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.prompt_len for r in requests)
